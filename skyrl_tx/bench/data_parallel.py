"""`python -m skyrl_tx.bench data-parallel`: one training step (forward_backward + optim_step) of the same global
batch on one process and on W ranks (Gloo on CPU, NCCL on GPUs) — data-parallel, or replicas of `--tp` tensor-parallel
ranks, with a MoE model's experts whole or spread (`--experts`) — for a LoRA adapter and for a full fine-tune
(ZeRO-sharded): per layout, rank 0's step time, its time inside collectives, the bytes it handed the collectives per
step and the optimizer state it holds, and the step time's ratio to one process.

Every layout runs in fresh processes (one per rank, the same threads in total), so layouts compare like for like;
the losses of the layouts must agree (the step is the same math), which the report checks."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

from skyrl_tx.bench.configs import CONFIGS, default_config
from skyrl_tx.bench.ranks import run_ranks

KINDS = ("lora", "full")
TIMEOUT_S = 900.0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m skyrl_tx.bench data-parallel",
                                description="Training step time, collective time and bytes per data-parallel layout.")
    p.add_argument("--device", default="cpu", help="cpu or cuda (rank r uses cuda:r)")
    p.add_argument("--config", choices=sorted(CONFIGS), help="model (default: cpu, or qwen3-0.6b on a GPU)")
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2], help="rank counts to run (1: no group)")
    p.add_argument("--tp", type=int, nargs="+", default=[1],
                   help="tensor-parallel sizes: each world runs once per size dividing it (world / tp replicas)")
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    p.add_argument("--experts", nargs="+", choices=("whole", "spread"), default=["whole"],
                   help="MoE configs: experts whole on every rank, or spread (over the tensor-parallel ranks, or with "
                        "tp 1 over the data-parallel ranks, all-to-all; LoRA only): each runs as its own layout")
    p.add_argument("--rows", type=int, help="sequences per step (default: the config's train batch x 2)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: the config's)")
    p.add_argument("--threads", type=int, help="torch threads in total, split over the ranks (default: all cores)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--reps", type=int, default=3, help="timed steps per layout (median reported)")
    return p


def _run_rank(job: dict[str, Any], rank: int) -> dict[str, Any]:
    import torch

    from skyrl_tx.backend.native import NativeBackend
    from skyrl_tx.bench import workloads as wl
    from skyrl_tx.config import BackendSettings
    from skyrl_tx.parallel.group import RankAddress, join_group, join_subgroups
    from skyrl_tx.parallel.layout import RankLayout
    from skyrl_tx.types import AdamParams, Datum, TrainRequest

    world, cuda = job["world"], job["device"] != "cpu"
    torch.set_num_threads(job["threads"])
    device = f"cuda:{rank}" if cuda else "cpu"
    full = job["kind"] == "full"
    settings = BackendSettings.from_dict(dict(
        dtype=job["dtype"], device=device, max_lora_adapters=1, max_lora_rank=job["lora_rank"],
        max_full_models=1 if full else 0, max_sampling_sequences=1, max_sampling_length=16,
        train_micro_batch_tokens=job["micro_batch_tokens"], fully_sharded_data_parallel_size=world // job["tp"],
        expert_parallel_size=(job["tp"] if job["tp"] > 1 else world) if job["experts"] == "spread" else 1))
    groups = []  # this rank's tensor- and data-parallel groups
    tensor_parallel = data_parallel = None
    if world > 1:
        join_group(RankAddress(job["address"], rank, world), device=device, timeout_s=TIMEOUT_S)
        layout = RankLayout(world, 1, job["address"], job["tp"])
        tensor_parallel, data_parallel = join_subgroups(rank, layout.tensor_parallel_groups(),
                                                        layout.data_parallel_groups(), timeout_s=TIMEOUT_S)
        groups = [g for g in (tensor_parallel, data_parallel) if g is not None]
    backend = NativeBackend(job["model_dir"], settings, tensor_parallel=tensor_parallel,
                            expert_parallel=data_parallel if settings.experts_over_data_parallel else None)
    if data_parallel is not None:
        backend.attach_collectives(data_parallel)
    backend.create_model("m", lora_rank=0 if full else job["lora_rank"], seed=1)
    gen = torch.Generator().manual_seed(0)  # the same batch on every rank and in every layout
    rows = torch.randint(10, job["vocab"], (job["rows"], job["seq_len"] + 1), generator=gen)  # [rows, T + 1]
    datums = [Datum(row[:-1], {"target_tokens": row[1:], "weights": torch.ones(job["seq_len"])}) for row in rows]
    request = [TrainRequest("m", datums)]
    params = AdamParams(learning_rate=wl.LEARNING_RATE, beta1=wl.BETAS[0], beta2=wl.BETAS[1], eps=wl.EPS)
    losses: list[float] = []

    def step() -> None:
        result = backend.forward_backward(request)
        backend.optim_step("m", params)
        if cuda:
            torch.cuda.synchronize(device)
        losses.append(result[0].metrics["loss:sum"])

    for _ in range(job["warmup"]):
        step()
    for group in groups:
        group.reset_stats()
    seconds = []
    for _ in range(job["reps"]):
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
    stats = [(kind, name, s) for kind, group in zip(("tp", "dp"), (tensor_parallel, data_parallel))
             if group is not None for name, s in group.stats().items()]
    reps = job["reps"]
    return {"step_s": statistics.median(seconds), "losses": losses,
            "collective_s": sum(s.seconds for _, _, s in stats) / reps,
            "collective_bytes": sum(s.bytes for _, _, s in stats) / reps,
            "by_op": {f"{kind}/{name}": {"calls": s.calls / reps, "bytes": s.bytes / reps, "seconds": s.seconds / reps}
                      for kind, name, s in stats},
            "optimizer_state_bytes": backend.optimizer_state_bytes("m")}


def _run_layout(job: dict[str, Any]) -> dict[str, Any]:
    """Rank 0's figures (the ranks run in lock-step) and every rank's losses."""
    results = run_ranks(_run_rank, job, job["world"], TIMEOUT_S, f"data-parallel bench, {job['kind']}")
    return {**results[0], "rank_losses": [results[r]["losses"] for r in sorted(results)]}


def run_data_parallel(argv: list[str]) -> dict:
    from skyrl_tx.bench.configs import model_dir

    args = _parser().parse_args(argv)
    cfg = CONFIGS[args.config or default_config(args.device)]
    path = model_dir(cfg)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    w = cfg.workload
    rows, seq_len = args.rows or 2 * w.train_batch, args.seq_len or w.train_seq_len
    total_threads = args.threads or os.cpu_count() or 1
    worlds = [1] + [x for x in args.worlds if x != 1]  # one process first: the reference of every ratio
    report: dict[str, Any] = {"config": cfg.name, "device": args.device, "rows": rows, "seq_len": seq_len,
                              "threads_total": total_threads, "reps": args.reps, "layouts": []}
    # Experts spread only where there is a group to spread them over (and, over data-parallel ranks, LoRA only).
    layouts = [(world, tp, experts) for world in worlds for tp in sorted(set(args.tp)) if world % tp == 0
               for experts in args.experts if experts == "whole" or world > 1]
    for kind in args.kinds:
        baseline = None
        for world, tp, experts in layouts:
            if kind == "full" and experts == "spread" and tp == 1:
                continue
            job = {"kind": kind, "world": world, "tp": tp, "experts": experts, "device": args.device,
                   "dtype": cfg.dtype, "model_dir": str(path), "vocab": vocab, "rows": rows, "seq_len": seq_len,
                   "lora_rank": w.lora_rank,
                   "threads": max(1, total_threads // world), "warmup": args.warmup, "reps": args.reps,
                   # a CPU reaches its GEMM peak from a few hundred rows: one sequence per micro-batch bounds memory
                   "micro_batch_tokens": seq_len if args.device == "cpu" else max(8192, rows * seq_len)}
            print(f"{kind}, {world} rank(s), tensor parallel {tp}, experts {experts} ...", file=sys.stderr, flush=True)
            got = _run_layout(job)
            baseline = baseline or got
            # The same math in every layout: every rank's losses equal one process's (up to summation order).
            same = all(abs(a - b) <= 1e-4 * max(1.0, abs(b)) for losses in got["rank_losses"]
                       for a, b in zip(losses, baseline["rank_losses"][0]))
            report["layouts"].append({"kind": kind, "world": world, "tp": tp, "experts": experts,
                                      **{k: v for k, v in got.items() if k not in ("losses", "rank_losses")},
                                      "step_ratio_to_one_process": got["step_s"] / baseline["step_s"],
                                      "same_losses_as_one_process": same})
    print(format_table(report), file=sys.stderr)
    print(json.dumps(report))
    return report


def format_table(report: dict[str, Any]) -> str:
    lines = [f"{report['config']} on {report['device']}: {report['rows']} x {report['seq_len']} tokens per step, "
             f"{report['threads_total']} threads in total, median of {report['reps']}",
             f"{'kind':<6}{'ranks':>6}{'tp':>4}{'experts':>8}{'step ms':>10}{'vs 1':>7}{'coll. ms':>10}{'coll. %':>9}"
             f"{'MB/step':>10}{'opt. MB/rank':>14}{'same':>6}"]
    for r in report["layouts"]:
        lines.append(f"{r['kind']:<6}{r['world']:>6}{r.get('tp', 1):>4}{r.get('experts', 'whole'):>8}"
                     f"{1e3 * r['step_s']:>10.1f}"
                     f"{r['step_ratio_to_one_process']:>7.2f}"
                     f"{1e3 * r['collective_s']:>10.1f}{100 * r['collective_s'] / r['step_s']:>9.1f}"
                     f"{r['collective_bytes'] / 1e6:>10.2f}{r['optimizer_state_bytes'] / 1e6:>14.2f}"
                     f"{'yes' if r['same_losses_as_one_process'] else 'NO':>6}")
    return "\n".join(lines)
