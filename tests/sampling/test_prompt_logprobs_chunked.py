"""Prompt logprobs are computed logprobs_chunk_tokens positions at a time ([chunk, vocab] logits alive, not
[prompt, vocab]) and equal the one-chunk (unchunked) computation."""

from __future__ import annotations

import math

import pytest
import torch
from sampling_reference import random_lora_weights, random_prompts

from skyrl_tx.backend.native import NativeBackend
from skyrl_tx.config import BackendSettings
from skyrl_tx.types import SampleRequest, SampleResult, SamplingParams

ADAPTER = "chunked-lora"
TOPK = 4


def make_backend(tiny_model_dir, chunk_tokens: int) -> NativeBackend:
    backend = NativeBackend(tiny_model_dir("tiny-qwen3"), BackendSettings(max_lora_adapters=1, max_lora_rank=4,
                                                                          logprobs_chunk_tokens=chunk_tokens))
    backend.create_model(ADAPTER, lora_rank=4, alpha=8.0)
    random_lora_weights(backend, ADAPTER, seed=3, scale=0.2)
    return backend


def prompt_results(backend: NativeBackend, prompts: list[list[int]], weights_id: str) -> list[SampleResult]:
    return backend.sample([SampleRequest(p, SamplingParams(max_tokens=1, temperature=0.0), weights_id=weights_id,
                                         prompt_logprobs=True, topk_prompt_logprobs=TOPK) for p in prompts])


@pytest.mark.parametrize("weights_id", ["", ADAPTER])
def test_chunked_prompt_logprobs_equal_unchunked(tiny_model_dir, weights_id: str) -> None:
    # 37 tokens = 36 scored positions: 9 chunks of 4, or 7 of 5 and a last one of 1; 9 tokens: 2 chunks + a short one.
    chunked = {n: make_backend(tiny_model_dir, n) for n in (4, 5)}
    whole = make_backend(tiny_model_dir, 4096)
    prompts = random_prompts(whole.decoder_config.vocab_size, [37, 9, 2], seed=8)
    expected = prompt_results(whole, prompts, weights_id)
    for n, backend in chunked.items():
        for prompt, got, want in zip(prompts, prompt_results(backend, prompts, weights_id), expected):
            what = f"chunk {n}, prompt of {len(prompt)}, weights {weights_id!r}"
            assert got.prompt_logprobs[0] is None and got.topk_prompt_logprobs[0] is None
            lp = torch.tensor(got.prompt_logprobs[1:], dtype=torch.float64)
            assert lp.numel() == len(prompt) - 1 and all(math.isfinite(x) for x in lp.tolist())
            diff = (lp - torch.tensor(want.prompt_logprobs[1:], dtype=torch.float64)).abs().max().item()
            assert diff <= 1e-6, f"{what}: prompt logprobs differ by {diff:.3g}"
            for t in range(1, len(prompt)):
                got_ids, got_values = zip(*got.topk_prompt_logprobs[t])
                want_ids, want_values = zip(*want.topk_prompt_logprobs[t])
                assert got_ids == want_ids, f"{what}: top-{TOPK} ids at position {t}"
                assert max(abs(a - b) for a, b in zip(got_values, want_values)) <= 1e-6, f"{what}: position {t}"
            # And the completion (from the last position's logits, not the chunks) is unchanged.
            assert got.sequences[0].tokens == want.sequences[0].tokens
    # The unchunked values are the training-side target logprobs (the formula the chunks must reproduce).
    (train_side,) = whole.token_logprobs([prompts[0][:-1]], [prompts[0][1:]], [weights_id])
    diff = (torch.tensor(expected[0].prompt_logprobs[1:]) - train_side).abs().max().item()
    assert diff <= 1e-5, f"unchunked prompt logprobs vs token_logprobs: {diff:.3g}"
