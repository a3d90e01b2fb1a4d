"""Smoke test of `python -m skyrl_tx.bench prefix-cache` (tiny config, one repetition): the report holds both
sides' times, cache hits of later turns and the same tokens with and without the cache. No timing assertions."""

from __future__ import annotations

from pathlib import Path

from bench_cli import last_line_report, run_bench

TIMEOUT_S = 300


def test_prefix_cache_benchmark_reports_hits_and_same_tokens(preset_cache: Path) -> None:
    report = last_line_report(run_bench("prefix-cache", "--config", "tiny", "--turns", "3", "--conversations", "2",
                                        "--system-tokens", "16", "--reps", "1", timeout_s=TIMEOUT_S))
    assert report["seconds_off"] > 0 and report["seconds_on"] > 0
    # Turn 1 of each conversation prefills the shared system prompt once; every later turn hits its own history.
    assert 0 < report["cache_hit_tokens"] < report["prompt_tokens"]
    assert report["same_tokens"] is True
