"""Smoke test of `python -m skyrl_tx.bench saves` (tiny model, one round, no upload delay): both modes report their
alone and with-save times and every save completed (a failed request fails the run). No timing assertions."""

from __future__ import annotations

from pathlib import Path

from bench_cli import last_line_report, run_bench

TIMEOUT_S = 300


def test_saves_benchmark_reports_both_modes(preset_cache: Path) -> None:
    report = last_line_report(run_bench("saves", "--size", "tiny", "--rounds", "1", "--upload-mb-s", "0",
                                        "--max-tokens", "8", timeout_s=TIMEOUT_S))
    assert set(report["modes"]) == {"background", "on-loop"}
    for mode in report["modes"].values():
        assert len(mode["alone_s"]) == len(mode["with_save_s"]) == 1 and "ratio" in mode
    assert report["checkpoint_mb"] > 0  # the last round's checkpoint was written and listed
