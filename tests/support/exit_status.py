"""pytest plugin: the test process ends with pytest's own exit status as soon as every result is reported, so a crash
while the interpreter shuts down cannot turn a passing run into a failure (tests/conftest.py loads it).

Why: the tests run the tinker SDK in this process, and its transport (pyqwest, tokio threads) can abort CPython 3.11's
finalization: a tokio thread that calls back into Python while the interpreter finalizes is made to pthread_exit by
take_gil, and the forced unwind aborts the process (SIGABRT, rc 134; tests/support/client_scripts.py has the core dump
and the same rule for client scripts). One all-passed CI run ended that way after its last test. Other threads left
at exit (the SDK's event-loop thread, the torch/OpenMP pool, libtorch's static destructors) add more teardown that can
only lose a verdict, never change one. So once the summary is printed, the process flushes its output and calls
os._exit(status): no atexit handlers, no finalization, no C++ static destructors. What is still running then is named
on stderr, so a leak shows in the log. Live servers and engine processes are stopped earlier, by their fixtures."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Generator
from pathlib import Path

import pytest


def still_running() -> str:
    """The Python threads other than this one, by name, and the process's native thread count (Linux)."""
    others = sorted(t.name for t in threading.enumerate() if t is not threading.current_thread())
    try:
        native = len(os.listdir(f"/proc/{os.getpid()}/task"))
    except OSError:
        native = 0
    if not others and native <= 1:
        return ""
    names = ", ".join(others) or "none"
    return f"{len(others)} Python thread(s) ({names}); {native or 'unknown'} native thread(s) in all"


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> Generator[None, None, None]:
    """The outermost wrapper: after it every other sessionfinish has run (terminal summary, junit XML, cache,
    tmp_path cleanup), and session.exitstatus is final (the terminal reporter may still raise it for
    --max-warnings). A sessionfinish that raised (pytest.exit in a plugin) propagates, and pytest exits its own way."""
    yield
    status = int(session.exitstatus)
    left = still_running()
    if left:
        sys.stderr.write(f"[{Path(__file__).name}] at exit: {left}; the process ends with os._exit({status})\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
