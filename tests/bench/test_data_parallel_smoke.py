"""Smoke test of `python -m skyrl_tx.bench data-parallel` (tiny config, one timed step): every layout reports its
step, collective time and bytes, the losses agree with one process, and the full fine-tune's ZeRO collectives move
what the layout says (a reduce-scatter of the gradients and an all-gather of the weights, float32, padded to the
ranks) while each rank holds half the optimizer state. No timing assertions."""

from __future__ import annotations

from pathlib import Path

from bench_cli import last_line_report, run_bench

TIMEOUT_S = 420


def test_data_parallel_benchmark_reports_collectives_per_layout(preset_cache: Path) -> None:
    report = last_line_report(run_bench("data-parallel", "--config", "tiny", "--reps", "1", "--threads", "2",
                                        "--tp", "1", "2", timeout_s=TIMEOUT_S))
    layouts = {(r["kind"], r["world"], r["tp"]): r for r in report["layouts"]}
    assert set(layouts) == {("lora", 1, 1), ("lora", 2, 1), ("lora", 2, 2), ("full", 1, 1), ("full", 2, 1),
                            ("full", 2, 2)}
    for r in layouts.values():
        assert r["step_s"] > 0 and r["same_losses_as_one_process"] is True, r
    for kind in ("lora", "full"):
        assert layouts[(kind, 1, 1)]["by_op"] == {} and layouts[(kind, 1, 1)]["collective_bytes"] == 0
        assert layouts[(kind, 2, 1)]["collective_s"] > 0
    # LoRA: the adapter's gradients in one all-reduce (plus the rows' outputs); its state stays replicated.
    assert set(layouts[("lora", 2, 1)]["by_op"]) == {"dp/all_reduce"}
    assert layouts[("lora", 2, 1)]["optimizer_state_bytes"] == layouts[("lora", 1, 1)]["optimizer_state_bytes"]
    # Tensor parallel: layer outputs summed (all_reduce), the log-softmax's max (all_reduce_max); each rank steps its
    # part of the adapter, so it holds less optimizer state than one process.
    tp = layouts[("lora", 2, 2)]
    assert set(tp["by_op"]) == {"tp/all_reduce", "tp/all_reduce_max"}, tp["by_op"]
    assert tp["optimizer_state_bytes"] < layouts[("lora", 1, 1)]["optimizer_state_bytes"]
    # Full fine-tuning, ZeRO: moments of P float32 parameters are 8P bytes in one process; 8 * ceil(P / 2) per rank.
    params = layouts[("full", 1, 1)]["optimizer_state_bytes"] // 8
    shard = -(-params // 2)
    full = layouts[("full", 2, 1)]
    assert full["optimizer_state_bytes"] == 8 * shard
    scatter = full["by_op"]["dp/reduce_scatter"]
    assert scatter == {"calls": 1, "bytes": 4 * 2 * shard, "seconds": scatter["seconds"]}
    gather = full["by_op"]["dp/all_gather"]
    assert gather["calls"] == 1 and gather["bytes"] == 4 * 2 * shard
    # Full fine-tuning split by tensor parallelism: each rank holds and steps its part (less than one process's).
    full_tp = layouts[("full", 2, 2)]
    assert "tp/all_reduce" in full_tp["by_op"], full_tp["by_op"]
    assert full_tp["optimizer_state_bytes"] < layouts[("full", 1, 1)]["optimizer_state_bytes"]
