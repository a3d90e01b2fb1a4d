"""Smoke test of `python -m skyrl_tx.bench gemm-share` (tiny config, one repetition): the profiler sees the GEMMs
the C++ core runs for a training step and for decode, and the report holds each part's pairs. No timing assertions:
a pair's wall time and GEMM time come from two runs, so on a busy machine even "ratio >= 1" does not hold."""

from __future__ import annotations

from pathlib import Path

from bench_cli import last_line_report, run_bench

TIMEOUT_S = 300


def test_gemm_share_benchmark_sees_the_cores_gemms(preset_cache: Path) -> None:
    proc = run_bench("gemm-share", "--config", "tiny", "--reps", "1", "--threads", "1", "--fused-ab",
                     timeout_s=TIMEOUT_S)
    report = last_line_report(proc)
    # The core's matmuls reach the profiler (decode's figures are differences of two runs: only their presence).
    assert report["train"]["gemm_by_op_s"].get("aten::mm", 0) > 0 and report["train"]["gemm_s"] > 0, report["train"]
    assert "aten::mm" in report["decode_batch_16"]["gemm_by_op_s"], report["decode_batch_16"]
    for part in ("train", "decode_batch_16"):
        measured = report[part]
        assert len(measured["ratios"]) == 1 and measured["ratio_range"] == [measured["ratio"]] * 2, measured
    assert report["train"]["tokens"] == 4 * 32 and report["decode_batch_16"]["steps"] == 31
    assert "gpuGetDeviceCount" not in proc.stderr
    ab = report["fused_ab"]  # --fused-ab: fused ops and formulas, both timed every repetition
    for part in ("train", "decode_batch_16"):
        assert len(ab[part]["fused_reps_s"]) == len(ab[part]["formulas_reps_s"]) == 1, ab
        # The one repetition's figure; decode's is a difference of two runs' times, so not even its sign is asserted.
        assert ab[part]["fused_s"] == ab[part]["fused_reps_s"][0], ab
