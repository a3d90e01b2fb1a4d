"""Smoke test of `python -m skyrl_tx.bench mixed` (two trainers, two samplers, 2 s phases): the harness reports
each side's rate alone and mixed, and their ratios. No timing assertions: the harness only."""

from __future__ import annotations

import json
from pathlib import Path

from bench_cli import run_bench


def test_mixed_benchmark_reports_both_sides(tmp_path: Path, preset_cache: Path) -> None:
    out = tmp_path / "mixed.json"
    run_bench("mixed", "--shares", "0.5", "--trainers", "2", "--samplers", "2", "--seconds", "2", "--max-tokens", "4",
              "--device", "cpu", "--json", str(out))
    [row] = json.loads(out.read_text())
    assert row["sampling_share"] == 0.5
    for key in ("train_steps_per_s_alone", "train_steps_per_s_mixed", "samples_per_s_alone", "samples_per_s_mixed"):
        assert row[key] > 0, row
    assert row["training_ratio"] == row["train_steps_per_s_mixed"] / row["train_steps_per_s_alone"]
