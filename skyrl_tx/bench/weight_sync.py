"""`python -m skyrl_tx.bench weight-sync`: how long the trainer takes to send new weights to sampler processes
through the C++ core's WeightSync (c10d: Gloo on CPU, NCCL on GPUs), for one LoRA adapter (rank 32 on every
projection, float32 factors) and for the full weights of the config's model (its dtype; default Qwen3-0.6B's shape).

The weights are random tensors of the model's shapes (no checkpoint is built); every layout runs in fresh processes,
the trainer as rank 0 and each receiver as a further rank (on a GPU node rank r uses cuda:r). Reported per payload:
the median sync time, bytes, buckets and GB/s, its ratio to one flat broadcast of the same bytes on the same group
into a freshly allocated buffer (the peer: what a receiver keeping each version must at least spend) and the time
of that broadcast into a reused buffer (the wire alone), and whether every receiver's digest equals the trainer's."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from skyrl_tx.bench.configs import CONFIGS
from skyrl_tx.bench.ranks import run_ranks

TIMEOUT_S = 900.0
PAYLOADS = ("adapter", "full")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m skyrl_tx.bench weight-sync",
                                description="Trainer-to-sampler weight sync time: one adapter and full weights.")
    p.add_argument("--device", default="cpu", help="cpu or cuda (rank r on cuda:r)")
    p.add_argument("--config", choices=sorted(CONFIGS), default="qwen3-0.6b", help="model shape (default qwen3-0.6b)")
    p.add_argument("--receivers", type=int, default=1, help="sampler processes receiving each sync")
    p.add_argument("--payloads", nargs="+", choices=PAYLOADS, default=list(PAYLOADS))
    p.add_argument("--lora-rank", type=int, default=32)
    p.add_argument("--bucket-mb", type=int, default=64)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--reps", type=int, default=3)
    return p


def model_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    """HF-named weight shapes of a dense Qwen3-style config (what a full fine-tuning sync sends)."""
    p = cfg.preset
    h, hd = p.hidden_size, p.head_dim
    vocab = cfg.vocab_size or 32000  # configs without a fixed vocabulary: a typical 32k
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    if not p.tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab, h)
    for i in range(p.num_hidden_layers):
        for name, shape in projection_shapes(cfg).items():
            shapes[f"model.layers.{i}.{name}.weight"] = shape
        for norm, size in (("input_layernorm", h), ("post_attention_layernorm", h), ("self_attn.q_norm", hd),
                           ("self_attn.k_norm", hd)):
            shapes[f"model.layers.{i}.{norm}.weight"] = (size,)
    return shapes


def projection_shapes(cfg: Any) -> dict[str, tuple[int, int]]:
    p = cfg.preset
    h, q, kv = p.hidden_size, p.num_attention_heads * p.head_dim, p.num_key_value_heads * p.head_dim
    return {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
            "self_attn.o_proj": (h, q), "mlp.gate_proj": (p.intermediate_size, h),
            "mlp.up_proj": (p.intermediate_size, h), "mlp.down_proj": (h, p.intermediate_size)}


def adapter_shapes(cfg: Any, rank: int) -> dict[str, tuple[int, int]]:
    """PEFT-named factor shapes of a LoRA adapter on every projection of every layer."""
    shapes = {}
    for i in range(cfg.preset.num_hidden_layers):
        for name, (out, inp) in projection_shapes(cfg).items():
            prefix = f"base_model.model.model.layers.{i}.{name}"
            shapes[f"{prefix}.lora_A.weight"], shapes[f"{prefix}.lora_B.weight"] = (rank, inp), (out, rank)
    return shapes


def _run_rank(job: dict[str, Any], rank: int) -> dict[str, Any]:
    import torch

    from skyrl_tx.parallel.group import RankAddress, join_group
    from skyrl_tx.parallel.weight_sync import make_weight_sync, weights_digest

    device = f"cuda:{rank}" if job["device"] != "cpu" else "cpu"
    group = join_group(RankAddress(job["address"], rank, job["world"]), device=device, timeout_s=TIMEOUT_S)
    sync = make_weight_sync(group, root=0, bucket_bytes=job["bucket_mb"] << 20)
    dtype = getattr(torch, job["dtype"])
    tensors = {}
    if rank == 0:  # random weights of the model's shapes, made once
        g = torch.Generator().manual_seed(0)
        tensors = {name: torch.randn(shape, generator=g).to(dtype).to(device) for name, shape in job["shapes"].items()}
    seconds, got = [], {}
    for rep in range(job["warmup"] + job["reps"]):
        if device != "cpu":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        got = sync.sync(rep, tensors, device)
        if device != "cpu":
            torch.cuda.synchronize(device)
        if rep >= job["warmup"]:
            seconds.append(time.perf_counter() - start)
    last = sync.last
    digest = weights_digest(got)
    del got
    # The peers: the same bytes as one flat broadcast (no manifest, no packing, no buckets) into a buffer allocated
    # for it (as a receiver keeping every version must: on a CPU, faulting in fresh pages is much of the cost) and
    # into one buffer reused every time (what the wire alone allows).
    def flat_broadcast(fresh: bool) -> float:
        flat, times = torch.zeros(last.bytes, dtype=torch.uint8, device=device), []  # [bytes]
        for rep in range(job["warmup"] + job["reps"]):
            start = time.perf_counter()
            if fresh:
                flat = torch.empty(last.bytes, dtype=torch.uint8, device=device)  # [bytes]
            group.broadcast(flat, 0)
            if device != "cpu":
                torch.cuda.synchronize(device)
            if rep >= job["warmup"]:
                times.append(time.perf_counter() - start)
        return statistics.median(times)

    return {"seconds": statistics.median(seconds), "flat_fresh_seconds": flat_broadcast(True),
            "flat_reused_seconds": flat_broadcast(False), "bytes": last.bytes, "buckets": last.buckets,
            "tensors": last.tensors, "digest": digest}


def _run(job: dict[str, Any]) -> dict[str, Any]:
    results = run_ranks(_run_rank, job, job["world"], TIMEOUT_S, "weight-sync bench")
    slowest = max(results.values(), key=lambda r: r["seconds"])  # a sync is done when every receiver has it
    return {**slowest, "same_digest_everywhere": len({r["digest"] for r in results.values()}) == 1}


def run_weight_sync(argv: list[str]) -> dict:
    args = _parser().parse_args(argv)
    cfg = CONFIGS[args.config]
    report: dict[str, Any] = {"config": cfg.name, "device": args.device, "receivers": args.receivers,
                              "bucket_mb": args.bucket_mb, "reps": args.reps, "payloads": []}
    for payload in args.payloads:
        shapes, dtype = ((adapter_shapes(cfg, args.lora_rank), "float32") if payload == "adapter"
                         else (model_shapes(cfg), cfg.dtype))
        print(f"{payload}: {len(shapes)} tensors ...", file=sys.stderr, flush=True)
        got = _run({"device": args.device, "world": 1 + args.receivers, "shapes": shapes, "dtype": dtype,
                    "bucket_mb": args.bucket_mb, "warmup": args.warmup, "reps": args.reps})
        figures = {k: v for k, v in got.items() if k != "digest"}
        report["payloads"].append({"payload": payload, "dtype": dtype, **figures,
                                   "gb_per_s": got["bytes"] / got["seconds"] / 1e9,
                                   "ratio_to_flat_broadcast": got["seconds"] / got["flat_fresh_seconds"]})
    lines = [f"weight sync, {cfg.name} shapes on {args.device}, {args.receivers} receiver(s), "
             f"{args.bucket_mb} MB buckets, median of {args.reps}",
             f"{'payload':<9}{'dtype':>10}{'tensors':>9}{'MB':>10}{'buckets':>9}{'ms':>10}{'GB/s':>8}"
             f"{'flat ms':>10}{'vs flat':>9}{'reused ms':>11}{'same':>6}"]
    for r in report["payloads"]:
        lines.append(f"{r['payload']:<9}{r['dtype']:>10}{r['tensors']:>9}{r['bytes'] / 1e6:>10.1f}{r['buckets']:>9}"
                     f"{1e3 * r['seconds']:>10.1f}{r['gb_per_s']:>8.2f}{1e3 * r['flat_fresh_seconds']:>10.1f}"
                     f"{r['ratio_to_flat_broadcast']:>9.2f}{1e3 * r['flat_reused_seconds']:>11.1f}"
                     f"{'yes' if r['same_digest_everywhere'] else 'NO':>6}")
    print("\n".join(lines), file=sys.stderr)
    print(json.dumps(report))
    return report
