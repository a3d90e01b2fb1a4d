"""Memory-saving options change nothing numerically: activation checkpointing, tiny micro-batches, tiny chunks."""

from __future__ import annotations

import pytest
import torch

from skyrl_tx.backend.native import NativeBackend
from skyrl_tx.config import BackendSettings
from skyrl_tx.types import Datum, TrainRequest


def make_data(vocab: int) -> list[Datum]:
    gen = torch.Generator().manual_seed(0)
    data = []
    for n in (9, 23, 4, 16, 31):
        tokens = torch.randint(0, vocab, (n + 1,), generator=gen)
        weights = torch.randn(n, generator=gen)  # negative weights included
        data.append(Datum(tokens[:-1], {"target_tokens": tokens[1:], "weights": weights}))
    return data


def grads_after_step(path, settings: BackendSettings, lora_rank: int) -> tuple[dict, list[torch.Tensor]]:
    backend = NativeBackend(path, settings)
    backend.create_model("m", lora_rank=lora_rank, alpha=16.0, seed=3)
    if lora_rank:  # make B nonzero so every LoRA factor gets a gradient
        state = backend.trainable_state("m")
        gen = torch.Generator().manual_seed(1)
        backend.set_adapter_weights("m", {k: torch.randn(v.shape, generator=gen) * 0.05 for k, v in state.items()})
    data = make_data(backend.decoder_config.vocab_size)
    result = backend.forward_backward([TrainRequest("m", data)])[0]
    return backend.trainable_grads("m"), [o["logprobs"] for o in result.loss_fn_outputs]


@pytest.mark.parametrize("lora_rank", [8, 0])
@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-llama3"])
def test_checkpointing_and_micro_batching_match_plain_run(tiny_model_dir, preset: str, lora_rank: int) -> None:
    path = tiny_model_dir(preset)
    reference, ref_logprobs = grads_after_step(path, BackendSettings(), lora_rank)
    variants = [BackendSettings(gradient_checkpointing=True),
                BackendSettings(train_micro_batch_tokens=24, logprobs_chunk_tokens=5),
                BackendSettings(train_micro_batch_size=2),  # the seed's row limit (planning: tests/cpp)
                BackendSettings(gradient_checkpointing=True, train_micro_batch_tokens=1, logprobs_chunk_tokens=1)]
    for settings in variants:
        grads, logprobs = grads_after_step(path, settings, lora_rank)
        assert grads.keys() == reference.keys()
        assert any(g.abs().max() > 0 for g in reference.values())
        for name, g in grads.items():
            # float32 sums in another order: differences of a few ulp of the largest gradient (~4e-6 of ~4).
            torch.testing.assert_close(g, reference[name], atol=1e-5, rtol=1e-5)
        for a, b in zip(logprobs, ref_logprobs):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
