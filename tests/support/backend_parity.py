"""Shared helpers of the per-architecture parity tests: random token sequences, our token logprobs, and a LoRA model
with random nonzero factors (so an adapter's every module changes the output)."""

from __future__ import annotations

import torch

from skyrl_tx.backend.native import NativeBackend


def seqs_of(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def ours(backend: NativeBackend, seqs: list[list[int]], adapters: list[str] | None = None) -> list[torch.Tensor]:
    """Each sequence's next-token logprobs under `backend` (one batch), per adapter ('' = the base model)."""
    return backend.token_logprobs([s[:-1] for s in seqs], [s[1:] for s in seqs], adapters)


RANK, ALPHA = 4, 8.0  # the parity suites' adapter shape (scale ALPHA / RANK = 2)


def random_adapter(backend: NativeBackend, model_id: str, seed: int, rank: int = RANK, alpha: float = ALPHA,
                   **targets) -> dict[str, torch.Tensor]:
    """A LoRA model whose A and B are both random and nonzero; returns its PEFT-named factors."""
    backend.create_model(model_id, lora_rank=rank, alpha=alpha, **targets)
    gen = torch.Generator().manual_seed(seed)
    state = {k: torch.randn(v.shape, generator=gen) * 0.1 for k, v in backend.trainable_state(model_id).items()}
    backend.set_adapter_weights(model_id, state)
    return state
