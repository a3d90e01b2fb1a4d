"""Smoke test of `python -m skyrl_tx.bench packing` (tiny config, one repetition): both layouts train on the same
mixed-length batch, the packed one over fewer tokens, and their first losses agree. No timing assertions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TIMEOUT_S = 300


@pytest.mark.parametrize("config", ["tiny"])
def test_packing_benchmark_runs_both_layouts(preset_cache: Path, config: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "skyrl_tx.bench", "packing", "--config", config, "--reps", "1",
                           "--threads", "1", "--sequences", "5"], env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S, check=False)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    lengths = report["lengths"]
    assert len(lengths) == 5 and max(lengths) == 64 and min(lengths) >= 4  # tiny: train_seq_len 32
    assert report["real_tokens"] == sum(lengths) < report["padded_tokens"] == 5 * 64
    for layout in ("packed", "padded"):
        assert len(report[layout]["reps_s"]) == 1 and report[layout]["step_s"] > 0
    first = report["first_loss_sum"]
    assert first["packed"] == pytest.approx(first["padded"], rel=1e-5), first
    assert 0 < report["packed_over_padded"]
