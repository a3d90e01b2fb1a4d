"""The test run's exit status is pytest's verdict even when the interpreter aborts while shutting down
(tests/support/exit_status.py): a small pytest run in a subprocess, with a crash registered for interpreter exit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

SUPPORT = Path(__file__).resolve().parent / "support"
TIMEOUT_S = 120
TESTS = """
import atexit, os

if os.environ.get("ABORT_AT_EXIT") == "1":  # a crash during interpreter teardown, after every result is in
    atexit.register(os.abort)


def test_passes():
    pass


def test_fails_when_asked():
    assert os.environ.get("FAIL") != "1"
"""


def run(tmp_path: Path, *, plugin: bool, fail: bool, abort: bool) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_inner.py").write_text(TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not the project's options (timeout, addopts)
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",  # seconds faster: no schemathesis, hypothesis...
           "PYTHONPATH": str(SUPPORT), "FAIL": str(int(fail)), "ABORT_AT_EXIT": str(int(abort))}
    args = [sys.executable, "-X", "faulthandler", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c",
            str(tmp_path / "pytest.ini"), "--rootdir", str(tmp_path), *(["-p", "exit_status"] if plugin else []),
            str(tmp_path / "test_inner.py")]
    return subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)


def test_without_the_plugin_an_abort_at_exit_fails_a_passing_run(tmp_path: Path) -> None:
    """The peer run: the crash this guards against really changes the status (SIGABRT, 134 in a shell)."""
    proc = run(tmp_path, plugin=False, fail=False, abort=True)
    assert "2 passed" in proc.stdout and proc.returncode == -signal.SIGABRT, (proc.returncode, proc.stdout)


@pytest.mark.parametrize("fail, status, summary", [(False, 0, "2 passed"), (True, 1, "1 failed, 1 passed")])
@pytest.mark.parametrize("abort", [False, True])
def test_the_status_is_the_verdict(tmp_path: Path, fail: bool, status: int, summary: str, abort: bool) -> None:
    proc = run(tmp_path, plugin=True, fail=fail, abort=abort)
    assert proc.returncode == status, (proc.returncode, proc.stdout, proc.stderr)
    assert summary in proc.stdout.splitlines()[-1], proc.stdout  # the summary is printed whole before the exit
