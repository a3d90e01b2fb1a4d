"""Smoke test of `python -m skyrl_tx.bench packing` (tiny config, one repetition): both layouts train (or, with
--prefill, prefill sampling prompts) on the same mixed-length batch, the packed one over fewer tokens, and their
first losses (first tokens' logprobs) agree. No timing assertions."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_cli import last_line_report, run_bench

TIMEOUT_S = 300


@pytest.mark.parametrize("workload", ["training", "prefill"])
def test_packing_benchmark_runs_both_layouts(preset_cache: Path, workload: str) -> None:
    extra = ["--prefill"] if workload == "prefill" else []
    report = last_line_report(run_bench("packing", "--config", "tiny", "--reps", "1", "--threads", "1",
                                        "--sequences", "5", *extra, timeout_s=TIMEOUT_S))
    lengths = report["lengths"]
    assert len(lengths) == 5 and max(lengths) == 64 and min(lengths) >= 4  # tiny: train_seq_len 32
    assert report["real_tokens"] == sum(lengths) < report["padded_tokens"] == 5 * 64
    for layout in ("packed", "padded"):
        assert len(report[layout]["reps_s"]) == 1 and report[layout]["step_s"] > 0
    assert report["workload"] == workload
    first = report["first_logprob_sum" if workload == "prefill" else "first_loss_sum"]
    assert first["packed"] == pytest.approx(first["padded"], rel=1e-5), first
    assert 0 < report["packed_over_padded"]
