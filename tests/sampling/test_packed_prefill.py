"""Packed sampling prefill (sample_packed_prefill, the default: prompts of mixed lengths prefill back to back in one
row with varlen attention, each token's K/V written to its request's cache row) equals right-padded prefill rows:
sampled tokens and logprobs (so the decode that reads the packed-written cache), prompt logprobs and their top-k,
with two adapters and the base model, several samples of one prompt, and a second round served from the prefix
cache that the packed prefill filled. Dense GQA, MLA + MoE, routed MoE and the hybrid Gated DeltaNet family (its
conv window and delta-rule state kept at each prompt's end)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from sampling_reference import random_lora_weights, random_prompts

from skyrl_tx.backend.native import NativeBackend
from skyrl_tx.config import BackendSettings
from skyrl_tx.types import SampleRequest, SampleResult, SamplingParams

PRESETS = ["tiny-qwen3", "tiny-deepseek-v3", "tiny-qwen3-moe", "tiny-qwen3.5"]
# float32 rounding: padded rows run the chunked delta rule and the matmuls over other shapes (the Gated DeltaNet
# state after a 12-token prompt moved a later sampled logprob of about -7 by 1.4e-5); the training twin allows 2e-5.
ATOL = 2e-5
LENGTHS = [37, 5, 12, 1, 20, 12]  # mixed, two equal; one single-token prompt
WEIGHTS = ["", "a", "b", "", "a", "b"]


def make_backend(path: Path, packed: bool) -> NativeBackend:
    backend = NativeBackend(path, BackendSettings(max_lora_adapters=3, max_lora_rank=4, sample_packed_prefill=packed))
    for model_id, seed in (("a", 1), ("b", 2)):
        backend.create_model(model_id, lora_rank=4, alpha=8.0)
        random_lora_weights(backend, model_id, seed=seed, scale=0.2)
    return backend


def sample(backend: NativeBackend, prompts: list[list[int]], score_prompts: bool = True) -> list[SampleResult]:
    requests = [SampleRequest(p, SamplingParams(max_tokens=6, temperature=1.0, seed=10 + i, stop=[]),
                              num_samples=2 if i == 0 else 1, weights_id=w, prompt_logprobs=score_prompts,
                              topk_prompt_logprobs=2 if score_prompts else 0)
                for i, (p, w) in enumerate(zip(prompts, WEIGHTS))]
    return backend.sample(requests)


def assert_same(got: list[SampleResult], want: list[SampleResult], what: str) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        where = f"{what}, request {i}"
        assert g.prompt_cache_hit_tokens == w.prompt_cache_hit_tokens, where
        for s, (gs, ws) in enumerate(zip(g.sequences, w.sequences, strict=True)):
            assert gs.tokens == ws.tokens, f"{where} sample {s}: tokens"
            diff = max(abs(a - b) for a, b in zip(gs.logprobs, ws.logprobs))
            assert diff <= ATOL, f"{where} sample {s}: sampled logprobs differ by {diff:.3g}"
        if w.prompt_logprobs is None:
            assert g.prompt_logprobs is None, where
            continue
        assert g.prompt_logprobs[0] is None and w.prompt_logprobs[0] is None
        got_lp, want_lp = torch.tensor(g.prompt_logprobs[1:]), torch.tensor(w.prompt_logprobs[1:])
        assert all(math.isfinite(x) for x in got_lp.tolist()), where
        if got_lp.numel():
            diff = (got_lp - want_lp).abs().max().item()
            assert diff <= ATOL, f"{where}: prompt logprobs differ by {diff:.3g}"
        for t in range(1, len(g.prompt_logprobs)):
            assert [i for i, _ in g.topk_prompt_logprobs[t]] == [i for i, _ in w.topk_prompt_logprobs[t]], where


@pytest.mark.parametrize("preset", PRESETS)
def test_packed_prefill_equals_padded_rows(tiny_model_dir, preset: str) -> None:
    path = tiny_model_dir(preset)
    packed, padded = make_backend(path, packed=True), make_backend(path, packed=False)
    prompts = random_prompts(packed.decoder_config.vocab_size, LENGTHS, seed=5)
    first = sample(packed, prompts)
    assert_same(first, sample(padded, prompts), f"{preset} first round")
    # The same prompts with a few more tokens, unscored (scored positions are always computed): the base model's rows
    # are served from the prefix cache the first round's prefill filled, where the model caches prefixes; the
    # adapters' prompts prefill packed again.
    longer = [p + q for p, q in zip(prompts, random_prompts(packed.decoder_config.vocab_size, [3] * len(prompts), 6))]
    second = sample(packed, longer, score_prompts=False)
    assert_same(second, sample(padded, longer, score_prompts=False), f"{preset} second round")
    if preset != "tiny-qwen3.5":  # a Gated DeltaNet model caches no prefixes
        assert second[0].prompt_cache_hit_tokens > 0, "the second round reads the packed prefill's cache rows"
    # And the sampled tokens are what a fresh forward pass scores them at (the cache the decode read is right).
    seq = first[1].sequences[0]
    full = prompts[1] + seq.tokens
    (train_side,) = packed.token_logprobs([full[:-1]], [full[1:]], [WEIGHTS[1]])
    diff = (train_side[-len(seq.tokens):] - torch.tensor(seq.logprobs)).abs().max().item()
    assert diff <= ATOL, f"{preset}: sampled logprobs vs a forward pass differ by {diff:.3g}"
