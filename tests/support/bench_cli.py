"""run_bench(): `python -m skyrl_tx.bench MODE ...` as a subprocess, the way the benchmark smoke tests run it: one
intra-op thread, a time limit, and the exit judged by client_scripts.exited_cleanly (several modes are tinker SDK
clients, so their exit can meet the SDK transport's known abort at interpreter finalization)."""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

from client_scripts import client_argv, exited_cleanly

TIMEOUT_S = 600


def run_bench(*args: str, timeout_s: float = TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """Runs the benchmark CLI with `args`; fails the test (with its output) unless it exited cleanly."""
    proc = subprocess.run(client_argv("-m", "skyrl_tx.bench", *args), env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=timeout_s, check=False)
    assert exited_cleanly(proc.returncode, proc.stderr), \
        f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    return proc


def last_line_report(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """The JSON report the modes without --json print as their last line of stdout."""
    return json.loads(proc.stdout.strip().splitlines()[-1])
