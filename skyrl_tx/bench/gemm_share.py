"""`python -m skyrl_tx.bench gemm-share`: a step's wall time over the time of its own GEMMs (issue 22, part 5).

A step can go no faster than its matrix multiplications; everything else (norms, RoPE, softmax, the loss, AdamW,
the C++ bookkeeping between ops) is overhead on top. This reports, for a LoRA training step (forward_backward of
`train_batch` rows + optim_step) and for one decode step at batch 16, the ratio

    wall time of the step / self time of its GEMM ops (aten::mm, addmm, bmm, baddbmm and their in-place forms)

The wall time is the median of unprofiled repetitions; the GEMM time is the median of as many more repetitions
under torch.profiler (the profiler's per-op cost lands outside the GEMMs' self time, so it does not inflate them;
one profiled run's GEMM time ranged from 878 to 1132 ms over six equal training runs on the 2-core machine).
Decode is isolated as (sample `new_tokens`) − (sample 1 token): the same prefill on both sides, so the difference
is `new_tokens − 1` decode steps. A ratio of 1.0 would be a step that is all GEMM; the issue's target is ≤ 1.25."""

from __future__ import annotations

import argparse
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
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per measurement (median reported)")
    p.add_argument("--threads", type=int, help="torch threads (default: the engine's choice)")
    p.add_argument("--fused-ab", action="store_true",
                   help="also time each step with the fused CPU ops on and off, alternating in this process")
    return p


def _wall(run: Callable[[], None], reps: int) -> float:
    """Median seconds of `reps` runs, after one untimed warm-up run."""
    return statistics.median(timed(run, 1, reps))


TOP_OTHER_OPS = 8  # the costliest non-GEMM ops are listed too: where the overhead is


def _gemm_seconds(run: Callable[[], None], reps: int) -> tuple[float, dict[str, float], dict[str, float]]:
    """Self CPU seconds of the GEMM ops, in all and per op name, and of the costliest others: the profiled run with
    the median GEMM total of `reps`."""
    import os

    os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # no "gpuGetDeviceCount failed" line on a host without a GPU
    from torch.profiler import ProfilerActivity, profile

    runs = []
    for _ in range(reps):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run()
        averages = prof.key_averages()
        per_op = {e.key: e.self_cpu_time_total / 1e6 for e in averages if e.key in GEMM_OPS}
        others = sorted(((e.self_cpu_time_total / 1e6, e.key) for e in averages if e.key not in GEMM_OPS),
                        reverse=True)
        runs.append((sum(per_op.values()), per_op, {key: seconds for seconds, key in others[:TOP_OTHER_OPS]}))
    runs.sort(key=lambda measured: measured[0])
    return runs[len(runs) // 2]


def measure(cfg_name: str, device: str, reps: int) -> dict[str, Any]:
    from skyrl_tx.bench import skyrl_side
    from skyrl_tx.bench.configs import model_dir

    cfg = CONFIGS[cfg_name]
    path = model_dir(cfg)
    report: dict[str, Any] = {"config": cfg.name, "device": device, "reps": reps}

    train = skyrl_side.build(wl.TRAIN_1, path, cfg, device)
    wall = _wall(train.run, reps)
    gemm, per_op, others = _gemm_seconds(train.run, reps)
    report["train"] = {"tokens": train.tokens, "step_s": wall, "gemm_s": gemm, "ratio": wall / gemm,
                       "gemm_by_op_s": per_op, "top_other_ops_s": others}
    del train

    decode = skyrl_side.build(wl.SAMPLE_16, path, cfg, device)
    assert decode.run_first_token is not None
    steps = cfg.workload.sample_new_tokens - 1
    wall_all, wall_first = _wall(decode.run, reps), _wall(decode.run_first_token, reps)
    gemm_all, per_op_all, others_all = _gemm_seconds(decode.run, reps)
    gemm_first, per_op_first, _ = _gemm_seconds(decode.run_first_token, reps)
    step_s, gemm_s = (wall_all - wall_first) / steps, (gemm_all - gemm_first) / steps
    report["decode_batch_16"] = {"steps": steps, "step_s": step_s, "gemm_s": gemm_s, "ratio": step_s / gemm_s,
                                 "gemm_by_op_s": {k: (v - per_op_first.get(k, 0.0)) / steps
                                                  for k, v in per_op_all.items()},
                                 "top_other_ops_s": others_all}  # of the whole sample call, prefill included
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
          f"{train['gemm_s'] * 1e3:.1f} ms: {train['ratio']:.2f}x\n"
          f"  decode step at batch 16: {decode['step_s'] * 1e3:.2f} ms, its GEMMs {decode['gemm_s'] * 1e3:.2f} ms: "
          f"{decode['ratio']:.2f}x", file=sys.stderr)
    if args.fused_ab:
        ab = report["fused_ab"] = fused_ab(report["config"], args.device, args.reps)
        print(f"  fused CPU ops on / off, alternating in this process (median of {args.reps}): training "
              f"{ab['train']['fused_s'] * 1e3:.1f} / {ab['train']['formulas_s'] * 1e3:.1f} ms = "
              f"{ab['train']['fused_over_formulas']:.3f}; decode step "
              f"{ab['decode_batch_16']['fused_s'] * 1e3:.2f} / {ab['decode_batch_16']['formulas_s'] * 1e3:.2f} ms = "
              f"{ab['decode_batch_16']['fused_over_formulas']:.3f}", file=sys.stderr)
    print(json.dumps(report))
    return report
