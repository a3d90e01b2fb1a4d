"""Smoke test of `python -m skyrl_tx.bench prefix-cache` (tiny config, one repetition): the report holds both
sides' times, cache hits of later turns and the same tokens with and without the cache. No timing assertions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TIMEOUT_S = 300


def test_prefix_cache_benchmark_reports_hits_and_same_tokens(preset_cache: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "skyrl_tx.bench", "prefix-cache", "--config", "tiny", "--turns", "3",
                           "--conversations", "2", "--system-tokens", "16", "--reps", "1"], env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["seconds_off"] > 0 and report["seconds_on"] > 0
    # Turn 1 of each conversation prefills the shared system prompt once; every later turn hits its own history.
    assert 0 < report["cache_hit_tokens"] < report["prompt_tokens"]
    assert report["same_tokens"] is True
