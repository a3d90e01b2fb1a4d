"""Trainer → sampler weight sync: the C++ core's WeightSync (csrc/dist/weight_sync.h) on a c10d group, and the debug
digest that proves a receiver holds exactly the trainer's weights of a version.

A sync is versioned: the trainer (the root) broadcasts a manifest and then the tensors in fixed-size buckets
(NCCL on GPUs, Gloo on CPUs); a receiver gets them bit for bit and keeps each version as a frozen snapshot, so a
sampling client on version k keeps getting version-k results while later versions arrive. LoRA syncs send one
model's adapter factors; full fine-tuning syncs send the full weights."""

from __future__ import annotations

import hashlib
from typing import Any

DEFAULT_BUCKET_BYTES = 64 << 20  # large enough to amortise a collective's latency, small enough to bound memory


def weights_digest(tensors: dict[str, Any]) -> str:
    """sha256 over every tensor's name, dtype, shape and raw bytes (sorted by name): equal digests mean the same
    weights bit for bit, on any device."""
    import torch

    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


JOIN_TIMEOUT_S = 600.0  # a sampler engine loads the base model within this (sampler_engine_pool.START_TIMEOUT_S)
SYNC_BUCKET_BYTES = 64 << 20


def join_sync_group(address: str, rank: int, world: int, timeout_s: float = JOIN_TIMEOUT_S, *,
                    device: str = "cpu") -> Any:
    """WeightSync on a fresh side group at `address`: the trainer is rank 0, rank 1 + e * T + t is tensor-parallel
    rank t of sampler engine e (engines of T ranks each). `device`: this rank's own CUDA device when the group is
    NCCL (layout.weight_sync_on_cuda), else "cpu"; every sync then passes the same device."""
    from skyrl_tx.parallel.group import RankAddress, join_side_group

    return make_weight_sync(join_side_group(RankAddress(address, rank, world), device=device, timeout_s=timeout_s),
                            root=0, bucket_bytes=SYNC_BUCKET_BYTES)


def make_weight_sync(group: Any, root: int = 0, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Any:
    """skyrl_tx._C.WeightSync over `group` (a skyrl_tx._C.Collectives, e.g. from parallel.group.join_group)."""
    from skyrl_tx._ext import load_extension

    return load_extension().WeightSync(group, root, bucket_bytes)
