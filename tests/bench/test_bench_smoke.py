"""Smoke tests of `python -m skyrl_tx.bench` (tiny config, one repetition) and `... api`: the JSON reports hold
every key with finite, positive measurements. No timing assertions: these check the harness, not the speed."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from bench_cli import run_bench

from skyrl_tx.bench.report import numeric_leaves
from skyrl_tx.bench.workloads import WORKLOADS

SIDE_KEYS = {"median_s", "tokens", "tokens_per_s", "peak_memory_bytes", "peak_rss_delta_bytes"}
SAMPLE_KEYS = {"first_token_s", "decode_step_s"}
TIMEOUT_S = 600


def bench_report(args: list[str], tmp_path: Path) -> dict:
    out = tmp_path / "report.json"
    run_bench(*args, "--json", str(out), timeout_s=TIMEOUT_S)
    return json.loads(out.read_text())


def assert_finite(report: dict) -> None:
    bad = {k: v for k, v in numeric_leaves(report).items() if not math.isfinite(v)}
    assert not bad, bad


def test_compute_benchmark_reports_every_workload(tmp_path: Path, preset_cache: Path) -> None:
    report = bench_report(["--config", "tiny", "--threads", "1", "--warmup", "0", "--reps", "1",
                        "--workloads", *WORKLOADS], tmp_path)
    assert_finite(report)
    assert set(report["workloads"]) == set(WORKLOADS)
    for name, entry in report["workloads"].items():
        for side in ("skyrl_tx", "hf_peft"):
            expected = SIDE_KEYS | (SAMPLE_KEYS if name.startswith("sample") else set())
            assert expected <= set(entry[side]), (name, side, sorted(entry[side]))
            assert len(entry[side]["reps_s"]) == 1
        assert {"speedup", "memory_ratio"} <= set(entry)
        measured = {k: v for k, v in numeric_leaves(entry).items()}
        assert all(v > 0 for v in measured.values()), {k: v for k, v in measured.items() if v <= 0}
    for target in report["targets"].values():
        assert target["value"] > 0 and isinstance(target["met"], bool)
    assert "train_8_adapters_vs_train_1_adapter_throughput" in report["targets"]
    assert report["device"] == "cpu" and report["threads"] == 1 and report["model"]["matmul_params"] > 0


def test_api_benchmark_reports_overheads(tmp_path: Path, preset_cache: Path) -> None:
    report = bench_report(["api", "--warmup", "1", "--reps", "3"], tmp_path)
    assert_finite(report)
    assert set(report["calls"]) == {"forward_backward", "optim_step", "sample"}
    for call, entry in report["calls"].items():
        for key in ("round_trip_p50_ms", "round_trip_p99_ms", "compute_p50_ms", "queue_p50_ms", "engine_p50_ms"):
            assert entry[key] > 0, (call, key, entry)
        assert "overhead_p50_ms" in entry and "overhead_p99_ms" in entry and entry["calls"] == 3
        # The SDK's own time is a real part of each round trip, and the server-added part excludes it.
        assert 0 < entry["sdk_outside_http_p50_ms"] < entry["round_trip_p50_ms"], entry
        assert entry["server_added_p50_ms"] < entry["overhead_p50_ms"], entry
        if sys.platform == "linux":  # CPU time per call of each process, from /proc (the SDK's always > 0)
            assert entry["client_cpu_ms_per_call"] > 0, entry
            assert entry["api_server_cpu_ms_per_call"] >= 0 and entry["engine_cpu_ms_per_call"] >= 0, entry
    assert report["targets"]["server_added_p50_ms"]["target"] == pytest.approx(5.0)
