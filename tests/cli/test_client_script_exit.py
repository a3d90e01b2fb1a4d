"""tests/support/client_scripts.py tells the SDK transport's abort during interpreter finalization (a clean exit)
from any other abort or failure of a client script."""

from __future__ import annotations

import subprocess

import pytest
from client_scripts import client_argv, exited_cleanly, finalization_abort


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(client_argv("-c", code), capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(("code", "clean", "at_finalization"), [
    ("print('done')", True, False),
    ("import atexit, os; atexit.register(os.abort); print('done')", True, True),  # aborts with no Python code running
    ("import os; os.abort()", False, False),  # aborts inside the script
    ("import os\ndef f():\n    os.abort()\nf()", False, False),
    ("raise SystemExit(3)", False, False),
])
def test_only_an_abort_at_interpreter_finalization_counts_as_a_clean_exit(code: str, clean: bool,
                                                                         at_finalization: bool) -> None:
    result = _run(code)
    assert finalization_abort(result.returncode, result.stderr) is at_finalization, (result.returncode, result.stderr)
    assert exited_cleanly(result.returncode, result.stderr) is clean, (result.returncode, result.stderr)
