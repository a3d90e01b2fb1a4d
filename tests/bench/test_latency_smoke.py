"""Smoke test of `python -m skyrl_tx.bench latency` (tiny model, a few steps, one hog): every run reports the step and
its phases from the server's futures table, each request's own phases from its per-request records (received ->
answered), and the in-process peer. No timing assertions."""

from __future__ import annotations

from pathlib import Path

from bench_cli import last_line_report, run_bench

from skyrl_tx.api.trace.build import PHASES

TIMEOUT_S = 300


def test_latency_benchmark_reports_phases_idle_beside_a_hog_and_the_peer(preset_cache: Path) -> None:
    report = last_line_report(run_bench("latency", "--steps", "4", "--warmup", "1", "--hogs", "1",
                                        timeout_s=TIMEOUT_S))
    assert set(report["runs"]) == {"idle", "1 CPU hog(s)", "in-process engine (peer)"}
    for label in ("idle", "1 CPU hog(s)"):
        run = report["runs"][label]
        assert set(run) == {"step", "forward_backward queue", "forward_backward engine", "optim_step queue",
                            "optim_step engine", "outside the engine"} | {
            f"{kind}: {phase}" for kind in ("forward_backward", "optim_step")
            for phase in (*PHASES, "stored -> claimed")}
        for kind in ("forward_backward", "optim_step"):  # recorded for every request (the API's moments too)
            for phase in ("storing the request", "queued", "computing", "waking the API", "answering"):
                assert set(run[f"{kind}: {phase}"]) == {"p50_ms", "p90_ms", "p99_ms"}, (kind, phase)
