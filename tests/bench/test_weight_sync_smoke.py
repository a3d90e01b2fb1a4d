"""Smoke test of `python -m skyrl_tx.bench weight-sync` (tiny shapes, two receivers, one timed sync): both payloads
arrive with the trainer's digest on every receiver, and the bytes and buckets are what the shapes and bucket size
say. No timing assertions."""

from __future__ import annotations

import math

from bench_cli import last_line_report, run_bench

TIMEOUT_S = 300


def test_weight_sync_benchmark_reports_both_payloads() -> None:
    from skyrl_tx.bench.configs import CONFIGS
    from skyrl_tx.bench.weight_sync import adapter_shapes, model_shapes

    report = last_line_report(run_bench("weight-sync", "--config", "tiny", "--receivers", "2", "--reps", "1",
                                        "--lora-rank", "8", "--bucket-mb", "1", timeout_s=TIMEOUT_S))
    by_payload = {r["payload"]: r for r in report["payloads"]}
    cfg = CONFIGS["tiny"]
    expected = {"adapter": (adapter_shapes(cfg, 8), 4), "full": (model_shapes(cfg), 4)}  # tiny is float32
    for payload, (shapes, element) in expected.items():
        r = by_payload[payload]
        assert r["same_digest_everywhere"] is True, r
        assert r["tensors"] == len(shapes)
        assert r["bytes"] == element * sum(math.prod(s) for s in shapes.values())
        # 1 MB buckets: each tensor of 1 MB or more is a bucket of its own, the small ones share theirs
        large = [s for s in shapes.values() if element * math.prod(s) >= 1 << 20]
        small_bytes = r["bytes"] - element * sum(math.prod(s) for s in large)
        assert len(large) + math.ceil(small_bytes / (1 << 20)) <= r["buckets"] <= len(shapes), r
        assert r["seconds"] > 0 and r["flat_fresh_seconds"] > 0
