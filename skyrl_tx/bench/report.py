"""Turns raw timings into the benchmark report: throughput, memory, MFU / roofline, ratios, targets; table + JSON."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from skyrl_tx.bench import workloads as wl
from skyrl_tx.bench.configs import BenchConfig
from skyrl_tx.bench.roofline import ModelShape, Peaks, decode_bytes_per_step, mfu, roofline_fraction

# Issue 8's goals (results to report, never asserted): speedup = HF time / skyrl_tx time for the same tokens.
SPEEDUP_TARGETS = {wl.TRAIN_1: 2.0, wl.TRAIN_N: 2.0, wl.SAMPLE_16: 3.0}
MFU_TARGET = (wl.TRAIN_1, 0.35)  # GPU: training model FLOP utilisation
ROOFLINE_TARGET = (wl.SAMPLE_64, 0.60)  # GPU: decode step time vs the memory-bandwidth floor
MULTI_ADAPTER_TARGET = (wl.TRAIN_8, wl.TRAIN_1, 0.90)  # the 8-adapter batch's tokens/s over one adapter's
SIDE_LABELS = {"skyrl_tx": "skyrl_tx", "hf_peft": "HF+PEFT"}

METHOD = ("Each side runs each workload in its own fresh process (same torch thread count), after warm-up; "
          "repetitions of the two sides alternate (ABBA) and the median is reported. Training: forward_backward "
          "with Tinker's summed cross-entropy plus an AdamW step per adapter; skyrl_tx batches all adapters in one "
          "forward_backward, PEFT switches adapters per request. Sampling: temperature-1 sampling of new_tokens "
          "per sequence with a LoRA adapter, no early stop; HF uses generate(). Memory: peak RSS growth over the "
          "process's RSS after imports (ru_maxrss), or torch.cuda.max_memory_allocated on GPU. decode_step_s = "
          "(time(new_tokens) - time(1 new token)) / (new_tokens - 1).")


def _side_metrics(raw: dict[str, Any], workload: str, cfg: BenchConfig, shape: ModelShape, peaks: Peaks,
                  device: str) -> dict[str, Any]:
    w = cfg.workload
    out: dict[str, Any] = {"median_s": raw["median_s"], "tokens": raw["tokens"],
                           "tokens_per_s": raw["tokens"] / raw["median_s"], "reps_s": raw["reps_s"]}
    memory = raw["memory"]
    out["peak_memory_bytes"] = memory["peak_gpu_bytes"] if device != "cpu" else memory["peak_rss_delta_bytes"]
    out["peak_rss_delta_bytes"] = memory["peak_rss_delta_bytes"]
    if wl.is_training(workload):
        if peaks.flops:
            out["mfu"] = mfu(shape, w.train_seq_len, out["tokens_per_s"], peaks.flops)
    else:
        steps = w.sample_new_tokens - 1
        out["first_token_s"] = raw["first_token_median_s"]
        out["decode_step_s"] = (raw["median_s"] - raw["first_token_median_s"]) / max(steps, 1)
        if peaks.bandwidth:
            dtype_bytes = 2 if cfg.dtype == "bfloat16" else 4
            step_bytes = decode_bytes_per_step(shape, dtype_bytes, w.lora_rank, wl.sample_batch(workload),
                                               w.sample_prompt_len, w.sample_new_tokens)
            out["decode_bytes_per_step"] = step_bytes
            out["roofline_fraction"] = roofline_fraction(step_bytes, out["decode_step_s"], peaks.bandwidth)
    return out


def build_report(raw: dict[str, dict[str, Any]], cfg: BenchConfig, shape: ModelShape, peaks: Peaks,
                 meta: dict[str, Any]) -> dict[str, Any]:
    workloads: dict[str, Any] = {}
    for workload, sides in raw.items():
        entry = {side: _side_metrics(r, workload, cfg, shape, peaks, meta["device"]) for side, r in sides.items()}
        sk, hf = entry["skyrl_tx"], entry["hf_peft"]
        entry["speedup"] = hf["median_s"] / sk["median_s"]
        entry["memory_ratio"] = sk["peak_memory_bytes"] / max(hf["peak_memory_bytes"], 1)
        workloads[workload] = entry
    targets = _targets(workloads)
    return {"benchmark": "compute", **meta, "method": METHOD, "model": {**shape.__dict__,
            "matmul_params": shape.matmul_params, "dtype": cfg.dtype, "config": cfg.name},
            "workload_sizes": cfg.workload.__dict__, "workloads": workloads, "targets": targets}


def _target(value: float, goal: float, at_least: bool) -> dict[str, Any]:
    return {"target": goal, "value": value, "met": value >= goal if at_least else value <= goal,
            "direction": ">=" if at_least else "<="}


def _targets(workloads: dict[str, Any]) -> dict[str, Any]:
    targets = {}
    for workload, goal in SPEEDUP_TARGETS.items():
        if workload in workloads:
            targets[f"{workload}_speedup"] = _target(workloads[workload]["speedup"], goal, True)
    for workload, entry in workloads.items():
        targets[f"{workload}_memory_ratio"] = _target(entry["memory_ratio"], 1.0, False)
    workload, goal = MFU_TARGET
    if "mfu" in workloads.get(workload, {}).get("skyrl_tx", {}):
        targets[f"{workload}_mfu"] = _target(workloads[workload]["skyrl_tx"]["mfu"], goal, True)
    workload, goal = ROOFLINE_TARGET
    if "roofline_fraction" in workloads.get(workload, {}).get("skyrl_tx", {}):
        targets[f"{workload}_roofline_fraction"] = _target(workloads[workload]["skyrl_tx"]["roofline_fraction"],
                                                           goal, True)
    many, one, goal = MULTI_ADAPTER_TARGET
    if many in workloads and one in workloads:
        ratio = workloads[many]["skyrl_tx"]["tokens_per_s"] / workloads[one]["skyrl_tx"]["tokens_per_s"]
        targets[f"{many}_vs_{one}_throughput"] = _target(ratio, goal, True)
    return targets


def _fmt_bytes(n: float) -> str:
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def format_table(report: dict[str, Any]) -> str:
    rows = [("workload", "metric", "skyrl_tx", "HF+PEFT", "skyrl_tx / HF")]
    for name, entry in report["workloads"].items():
        sk, hf = entry["skyrl_tx"], entry["hf_peft"]
        rows.append((name, "tokens/s", f"{sk['tokens_per_s']:.1f}", f"{hf['tokens_per_s']:.1f}",
                     f"{entry['speedup']:.2f}x faster"))
        rows.append(("", "peak memory", _fmt_bytes(sk["peak_memory_bytes"]), _fmt_bytes(hf["peak_memory_bytes"]),
                     f"{entry['memory_ratio']:.2f}x memory"))
        if "decode_step_s" in sk:
            ratio = hf["decode_step_s"] / sk["decode_step_s"]
            rows.append(("", "decode step", f"{sk['decode_step_s'] * 1e3:.2f} ms",
                         f"{hf['decode_step_s'] * 1e3:.2f} ms", f"{ratio:.2f}x faster"))
        for key, label in (("mfu", "MFU"), ("roofline_fraction", "of BW roofline")):
            if key in sk:
                rows.append(("", label, f"{sk[key] * 100:.1f}%", f"{hf[key] * 100:.1f}%", ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    goals = [f"  {k}: {v['value']:.2f} (target {v['direction']} {v['target']:g}) "
             f"{'met' if v['met'] else 'MISSED'}" for k, v in report["targets"].items()]
    return "\n".join(lines + ["", "targets:"] + goals)


def numeric_leaves(obj: Any, prefix: str = "") -> dict[str, float]:
    """Every number in the report by dotted path (booleans excluded): what the smoke test checks."""
    if isinstance(obj, bool):
        return {}
    if isinstance(obj, (int, float)):
        return {prefix: float(obj)}
    if isinstance(obj, dict):
        return {k: v for key, val in obj.items() for k, v in numeric_leaves(val, f"{prefix}.{key}".lstrip(".")).items()}
    if isinstance(obj, list):
        return {k: v for i, val in enumerate(obj) for k, v in numeric_leaves(val, f"{prefix}[{i}]").items()}
    return {}


def write_json(report: dict[str, Any], path: Path) -> None:
    bad = [k for k, v in numeric_leaves(report).items() if not math.isfinite(v)]
    if bad:
        raise ValueError(f"bench report: non-finite values at {', '.join(bad)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
