"""Smoke test of `python -m skyrl_tx.bench mixed` (two trainers, two samplers, 2 s phases): the harness reports
each side's rate alone and mixed, and their ratios. No timing assertions: the harness only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_mixed_benchmark_reports_both_sides(tmp_path: Path, preset_cache: Path) -> None:
    out = tmp_path / "mixed.json"
    proc = subprocess.run([sys.executable, "-m", "skyrl_tx.bench", "mixed", "--shares", "0.5", "--trainers", "2",
                           "--samplers", "2", "--seconds", "2", "--max-tokens", "4", "--device", "cpu", "--json",
                           str(out)],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    [row] = json.loads(out.read_text())
    assert row["sampling_share"] == 0.5
    for key in ("train_steps_per_s_alone", "train_steps_per_s_mixed", "samples_per_s_alone", "samples_per_s_mixed"):
        assert row[key] > 0, row
    assert row["training_ratio"] == row["train_steps_per_s_mixed"] / row["train_steps_per_s_alone"]
