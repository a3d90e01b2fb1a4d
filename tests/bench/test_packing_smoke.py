"""Smoke test of `python -m skyrl_tx.bench packing` (tiny config, one repetition): both layouts train (or, with
--prefill, prefill sampling prompts) on the same mixed-length batch, the packed one over fewer tokens, and their
first losses (first tokens' logprobs) agree. No timing assertions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TIMEOUT_S = 300


@pytest.mark.parametrize("workload", ["training", "prefill"])
def test_packing_benchmark_runs_both_layouts(preset_cache: Path, workload: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    extra = ["--prefill"] if workload == "prefill" else []
    proc = subprocess.run([sys.executable, "-m", "skyrl_tx.bench", "packing", "--config", "tiny", "--reps", "1",
                           "--threads", "1", "--sequences", "5", *extra], env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S, check=False)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    lengths = report["lengths"]
    assert len(lengths) == 5 and max(lengths) == 64 and min(lengths) >= 4  # tiny: train_seq_len 32
    assert report["real_tokens"] == sum(lengths) < report["padded_tokens"] == 5 * 64
    for layout in ("packed", "padded"):
        assert len(report[layout]["reps_s"]) == 1 and report[layout]["step_s"] > 0
    assert report["workload"] == workload
    first = report["first_logprob_sum" if workload == "prefill" else "first_loss_sum"]
    assert first["packed"] == pytest.approx(first["padded"], rel=1e-5), first
    assert 0 < report["packed_over_padded"]
