"""GPU tests' backends: a NativeBackend on "cuda" with adapters "a" and "b" of random nonzero factors."""

from __future__ import annotations

from pathlib import Path

import torch

from skyrl_tx.backend.native import NativeBackend
from skyrl_tx.config import BackendSettings


def cuda_backend_with_adapters(path: Path, **settings) -> NativeBackend:
    """Rank-4 adapters "a" and "b" (alpha 8) with factors ~ N(0, 0.05^2), seeded; `settings`: BackendSettings keys
    beside device "cuda" and two rank-8 adapter slots (dtype too: bfloat16 unless given)."""
    settings = {"dtype": "bfloat16", **settings}
    backend = NativeBackend(path, BackendSettings(max_lora_adapters=2, max_lora_rank=8, device="cuda", **settings))
    for i, name in enumerate(("a", "b")):
        backend.create_adapter(name, rank=4, alpha=8.0)
        gen = torch.Generator().manual_seed(10 + i)
        backend.set_adapter_weights(name, {k: torch.randn(v.shape, generator=gen) * 0.05
                                           for k, v in sorted(backend.adapter_state_dict(name).items())})
    return backend
