"""Smoke test of `python -m skyrl_tx.bench data-parallel` (tiny config, one timed step): every layout reports its
step, collective time and bytes, the losses agree with one process, and the full fine-tune's ZeRO collectives move
what the layout says (a reduce-scatter of the gradients and an all-gather of the weights, float32, padded to the
ranks) while each rank holds half the optimizer state. No timing assertions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TIMEOUT_S = 420


def test_data_parallel_benchmark_reports_collectives_per_layout(preset_cache: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "skyrl_tx.bench", "data-parallel", "--config", "tiny", "--reps", "1",
                           "--threads", "2"], env=env, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    layouts = {(r["kind"], r["world"]): r for r in report["layouts"]}
    assert set(layouts) == {("lora", 1), ("lora", 2), ("full", 1), ("full", 2)}
    for r in layouts.values():
        assert r["step_s"] > 0 and r["same_losses_as_one_process"] is True, r
    for kind in ("lora", "full"):
        assert layouts[(kind, 1)]["by_op"] == {} and layouts[(kind, 1)]["collective_bytes"] == 0
        assert layouts[(kind, 2)]["collective_s"] > 0
    # LoRA: the adapter's gradients in one all-reduce (plus the rows' outputs); its state stays replicated.
    assert set(layouts[("lora", 2)]["by_op"]) == {"all_reduce"}
    assert layouts[("lora", 2)]["optimizer_state_bytes"] == layouts[("lora", 1)]["optimizer_state_bytes"]
    # Full fine-tuning, ZeRO: moments of P float32 parameters are 8P bytes in one process; 8 * ceil(P / 2) per rank.
    params = layouts[("full", 1)]["optimizer_state_bytes"] // 8
    shard = -(-params // 2)
    full = layouts[("full", 2)]
    assert full["optimizer_state_bytes"] == 8 * shard
    assert full["by_op"]["reduce_scatter"] == {"calls": 1, "bytes": 4 * 2 * shard, "seconds": full["by_op"]["reduce_scatter"]["seconds"]}
    assert full["by_op"]["all_gather"]["calls"] == 1 and full["by_op"]["all_gather"]["bytes"] == 4 * 2 * shard
