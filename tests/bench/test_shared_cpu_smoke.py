"""Smoke test of `python -m skyrl_tx.bench shared-cpu` (two steps per load): both thread policies report step
p50/p90 idle and beside a busy process, and which threads the engine ran. No timing assertions: the harness only."""

from __future__ import annotations

import json
import os
from pathlib import Path

from bench_cli import run_bench

TIMEOUT_S = 600


def test_shared_cpu_benchmark_reports_both_policies(tmp_path: Path, preset_cache: Path) -> None:
    out = tmp_path / "report.json"
    # (run_bench sets OMP_NUM_THREADS=1; the bench removes it from its servers: their policy decides)
    proc = run_bench("shared-cpu", "--rounds", "1", "--steps", "2", "--warmup", "0", "--json", str(out),
                     timeout_s=TIMEOUT_S)
    report = json.loads(out.read_text())
    assert set(report["policies"]) == {"torch", "fit"}
    for name, policy in report["policies"].items():
        for load in ("idle", "busy"):
            entry = policy[load]
            assert entry["steps"] == 2 and len(entry["steps_s"]) == 2, (name, load, entry)
            assert 0 < entry["p50_s"] <= entry["p90_s"], (name, load, entry)
        assert policy["busy_p90_over_p50"] >= 1 and policy["busy_over_idle_p50"] > 0
        assert isinstance(policy["met"], bool)
    assert report["policies"]["torch"]["engine_threads"].startswith("torch defaults")
    cores = len(os.sched_getaffinity(0))
    assert f"intra-op {max(1, cores - 1)}, inter-op 1 (default: " in report["policies"]["fit"]["engine_threads"]
    assert "target: busy p90" in proc.stdout
