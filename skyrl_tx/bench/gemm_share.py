"""`python -m skyrl_tx.bench gemm-share`: a step's wall time over the time of its own GEMMs (issue 22, part 5).

A step can go no faster than its matrix multiplications; everything else (norms, RoPE, softmax, the loss, AdamW,
the C++ bookkeeping between ops) is overhead on top. This reports, for a LoRA training step (forward_backward of
`train_batch` rows + optim_step) and for one decode step at batch 16, the ratio

    wall time of the step / self time of its GEMM ops (aten::mm, addmm, bmm, baddbmm and their in-place forms)

Each repetition is a pair run back to back: one unprofiled run for the wall time, then one under torch.profiler
for the GEMMs' self time (the profiler's per-op cost lands outside the GEMMs' self time, so it does not inflate
them). The reported ratio is the median of the pairs' ratios, with their range: the machine's speed drifts (one
profiled run's GEMM time ranged from 878 to 1132 ms over six equal training runs on the 2-core machine), pairing
keeps drift between minutes out of the ratio, and the range shows the noise that is left. Decode is isolated as
(sample `new_tokens`) − (sample 1 token): the same prefill on both sides, so the difference is `new_tokens − 1`
decode steps. A ratio of 1.0 would be a step that is all GEMM; the issue's target is ≤ 1.25."""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from collections.abc import Callable
from typing import Any

from skyrl_tx.bench import workloads as wl
from skyrl_tx.bench.configs import CONFIGS, default_config
from skyrl_tx.bench.timing import timed

# The profiler's names of the ops that are GEMMs, in-place forms included (LoRA's expand accumulates with addmm_).
# Attention is not among them: the fused SDPA kernel is reported with the other ops.
GEMM_OPS = frozenset({"aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm", "aten::baddbmm_"})


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m skyrl_tx.bench gemm-share",
                                description="Step wall time over the time of its own GEMMs (training and decode).")
    p.add_argument("--device", default="cpu", help="cpu only: on a GPU the GEMMs run asynchronously to the host")
    p.add_argument("--config", choices=sorted(CONFIGS), help="model + workload sizes (default: cpu)")
    p.add_argument("--reps", type=int, default=5,
                   help="pairs of runs (unprofiled, then profiled) per measurement (medians reported)")
    p.add_argument("--threads", type=int, help="torch threads (default: the engine's choice)")
    p.add_argument("--fused-ab", action="store_true",
                   help="also time each step with the fused CPU ops on and off, alternating in this process")
    return p


TOP_OTHER_OPS = 8  # the costliest non-GEMM ops are listed too: where the overhead is


@dataclasses.dataclass(frozen=True)
class Profiled:
    """One profiled run: the GEMM ops' self CPU seconds, in all and per op name, and the costliest other ops'."""

    gemm_s: float
    gemm_by_op_s: dict[str, float]
    top_other_ops_s: dict[str, float]


def _profiled(run: Callable[[], None]) -> Profiled:
    import os

    os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # no "gpuGetDeviceCount failed" line on a host without a GPU
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    averages = prof.key_averages()
    per_op = {e.key: e.self_cpu_time_total / 1e6 for e in averages if e.key in GEMM_OPS}
    others = sorted(((e.self_cpu_time_total / 1e6, e.key) for e in averages if e.key not in GEMM_OPS), reverse=True)
    return Profiled(sum(per_op.values()), per_op, {key: seconds for seconds, key in others[:TOP_OTHER_OPS]})


def _pair(run: Callable[[], None]) -> tuple[float, Profiled]:
    """An unprofiled run's wall seconds and, right after it, a profiled run."""
    return _seconds(run), _profiled(run)


def _summary(walls: list[float], gemms: list[float]) -> dict[str, Any]:
    """Medians of the step and GEMM seconds, and of the pairs' ratios with their range."""
    ratios = [wall / gemm for wall, gemm in zip(walls, gemms, strict=True)]
    return {"step_s": statistics.median(walls), "gemm_s": statistics.median(gemms),
            "ratio": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)], "ratios": ratios}


def _median_run(pairs: list[tuple[float, Profiled]]) -> Profiled:
    """The profiled run with the median GEMM time: its per-op figures are the ones reported."""
    return sorted((profiled for _, profiled in pairs), key=lambda p: p.gemm_s)[len(pairs) // 2]


def measure(cfg_name: str, device: str, reps: int) -> dict[str, Any]:
    from skyrl_tx.bench import skyrl_side
    from skyrl_tx.bench.configs import model_dir

    cfg = CONFIGS[cfg_name]
    path = model_dir(cfg)
    report: dict[str, Any] = {"config": cfg.name, "device": device, "reps": reps}

    train = skyrl_side.build(wl.TRAIN_1, path, cfg, device)
    train.run()  # warm-up: the first step allocates
    pairs = [_pair(train.run) for _ in range(reps)]
    shown = _median_run(pairs)
    report["train"] = {"tokens": train.tokens,
                       **_summary([wall for wall, _ in pairs], [profiled.gemm_s for _, profiled in pairs]),
                       "gemm_by_op_s": shown.gemm_by_op_s, "top_other_ops_s": shown.top_other_ops_s}
    del train

    decode = skyrl_side.build(wl.SAMPLE_16, path, cfg, device)
    assert decode.run_first_token is not None
    steps = cfg.workload.sample_new_tokens - 1
    # Per repetition: all tokens and the first token only, each as a pair; their difference is `steps` decode steps.
    decode.run()
    decode.run_first_token()
    all_pairs: list[tuple[float, Profiled]] = []
    first_pairs: list[tuple[float, Profiled]] = []
    for _ in range(reps):
        all_pairs.append(_pair(decode.run))
        first_pairs.append(_pair(decode.run_first_token))
    walls = [(a - f) / steps for (a, _), (f, _) in zip(all_pairs, first_pairs, strict=True)]
    gemms = [(a.gemm_s - f.gemm_s) / steps for (_, a), (_, f) in zip(all_pairs, first_pairs, strict=True)]
    shown_all, shown_first = _median_run(all_pairs), _median_run(first_pairs)
    report["decode_batch_16"] = {"steps": steps, **_summary(walls, gemms),
                                 "gemm_by_op_s": {k: (v - shown_first.gemm_by_op_s.get(k, 0.0)) / steps
                                                  for k, v in shown_all.gemm_by_op_s.items()},
                                 "top_other_ops_s": shown_all.top_other_ops_s}  # of the whole sample call
    return report


def fused_ab(cfg_name: str, device: str, reps: int) -> dict[str, Any]:
    """The fused CPU ops (csrc/ops) against their ATen formulas, in this process: each repetition times the training
    step and the decode workload once with the ops on and once off (the order alternating), so the machine's drift
    between runs (GEMM time alone moved by 18% between equal processes) lands on both sides. Medians; a ratio < 1 is
    a gain."""
    from skyrl_tx._ext import load_extension
    from skyrl_tx.bench import skyrl_side
    from skyrl_tx.bench.configs import model_dir

    native = load_extension()
    if not native._set_fused_cpu_ops(True):
        raise SystemExit("--fused-ab: this CPU or build has no fused CPU ops (they need x86-64 with AVX2 and FMA)")
    cfg = CONFIGS[cfg_name]
    path = model_dir(cfg)
    steps = cfg.workload.sample_new_tokens - 1
    train = skyrl_side.build(wl.TRAIN_1, path, cfg, device)
    decode = skyrl_side.build(wl.SAMPLE_16, path, cfg, device)
    assert decode.run_first_token is not None
    parts = {"train": lambda: _seconds(train.run),  # one step
             "decode_batch_16": lambda: (_seconds(decode.run) - _seconds(decode.run_first_token)) / steps}
    times: dict[str, dict[bool, list[float]]] = {part: {True: [], False: []} for part in parts}
    for on in (True, False):  # warm-up: each side's first run allocates
        native._set_fused_cpu_ops(on)
        for measure_once in parts.values():
            measure_once()
    for rep in range(reps):
        for on in ((True, False) if rep % 2 == 0 else (False, True)):
            native._set_fused_cpu_ops(on)
            for part, measure_once in parts.items():
                times[part][on].append(measure_once())
    native._set_fused_cpu_ops(True)
    report = {}
    for part, by_state in times.items():
        fused, formulas = statistics.median(by_state[True]), statistics.median(by_state[False])
        report[part] = {"fused_s": fused, "formulas_s": formulas, "fused_over_formulas": fused / formulas,
                        "fused_reps_s": by_state[True], "formulas_reps_s": by_state[False]}
    return report


def _seconds(run: Callable[[], None]) -> float:
    return timed(run, 0, 1)[0]


def _ratio_text(part: dict[str, Any]) -> str:
    low, high = part["ratio_range"]
    return f"{part['ratio']:.2f}x (median of the pairs' ratios; range {low:.2f}-{high:.2f}x)"


def run_gemm_share(argv: list[str]) -> dict[str, Any]:
    import torch

    from skyrl_tx.engine.threads import choose_threads

    args = _parser().parse_args(argv)
    if args.device != "cpu":
        raise SystemExit("gemm-share measures host time: --device cpu only (on a GPU, use the compute benchmark's "
                         "MFU and roofline columns)")
    threads = args.threads or choose_threads(args.device).intra_op or torch.get_num_threads()
    torch.set_num_threads(threads)
    report = measure(args.config or default_config(args.device), args.device, args.reps)
    report["threads"] = threads
    train, decode = report["train"], report["decode_batch_16"]
    print(f"{report['config']} on {args.device} ({threads} threads), median of {args.reps}:\n"
          f"  training step ({train['tokens']} tokens): {train['step_s'] * 1e3:.1f} ms, its GEMMs "
          f"{train['gemm_s'] * 1e3:.1f} ms: {_ratio_text(train)}\n"
          f"  decode step at batch 16: {decode['step_s'] * 1e3:.2f} ms, its GEMMs {decode['gemm_s'] * 1e3:.2f} ms: "
          f"{_ratio_text(decode)}", file=sys.stderr)
    if args.fused_ab:
        ab = report["fused_ab"] = fused_ab(report["config"], args.device, args.reps)
        print(f"  fused CPU ops on / off, alternating in this process (median of {args.reps}): training "
              f"{ab['train']['fused_s'] * 1e3:.1f} / {ab['train']['formulas_s'] * 1e3:.1f} ms = "
              f"{ab['train']['fused_over_formulas']:.3f}; decode step "
              f"{ab['decode_batch_16']['fused_s'] * 1e3:.2f} / {ab['decode_batch_16']['formulas_s'] * 1e3:.2f} ms = "
              f"{ab['decode_batch_16']['fused_over_formulas']:.3f}", file=sys.stderr)
    print(json.dumps(report))
    return report
