"""Sampling the non-Llama-like presets (MoE, MLA's latent cache, Qwen3.5's recurrent DeltaNet state next to the KV
cache; continuous batching): greedy equals transformers generate, sampled and prompt logprobs equal a forward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_reference import load_hf_model
from moe_reference import merge_into
from sampling_reference import assert_greedy_matches, completion_logprobs, greedy_requests, hf_greedy, random_prompts

from skyrl_tx.backend.native import NativeBackend
from skyrl_tx.config import BackendSettings
from skyrl_tx.types import SampleRequest, SamplingParams

PRESETS = ["tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-qwen3.5", "tiny-qwen3.5-moe"]
LENGTHS = [1, 4, 13, 70]  # packed into one prefill; 70 spans two of the delta rule's 64-token chunks
MAX_NEW = 16
RANK, ALPHA = 4, 8.0


def backend_with_random_adapter(path: Path, **settings) -> tuple[Path, NativeBackend, dict[str, torch.Tensor]]:
    """A backend of `path` (BackendSettings keys `settings` on top) holding "lora", a random nonzero adapter."""
    torch.set_num_threads(1)
    backend = NativeBackend(path, BackendSettings(max_lora_adapters=2, max_lora_rank=8, **settings))
    backend.create_model("lora", lora_rank=RANK, alpha=ALPHA)
    gen = torch.Generator().manual_seed(7)
    state = {k: torch.randn(v.shape, generator=gen) * 0.2 for k, v in backend.trainable_state("lora").items()}
    backend.set_adapter_weights("lora", state)
    return path, backend, state


@pytest.fixture(scope="module", params=PRESETS)
def env(request: pytest.FixtureRequest, tiny_model_dir) -> tuple[Path, NativeBackend, dict[str, torch.Tensor]]:
    return backend_with_random_adapter(tiny_model_dir(request.param))


def test_greedy_base_and_adapter_in_one_batch_match_transformers(env) -> None:
    """Recurrent-state decode (Qwen3.5) must agree with transformers' chunked prefill + recurrent decode."""
    path, backend, state = env
    prompts = random_prompts(backend.decoder_config.vocab_size, LENGTHS, seed=0, avoid=backend.eos_token_ids)
    requests = []
    for p in prompts:
        requests += greedy_requests([p], MAX_NEW, "lora") + greedy_requests([p], MAX_NEW)
    results = backend.sample(requests)
    adapted = [r.sequences[0].tokens for r in results[0::2]]
    base = [r.sequences[0].tokens for r in results[1::2]]
    compared = 0
    for what, model, got in [("base", load_hf_model(path), base),
                             ("lora", merge_into(load_hf_model(path), state, ALPHA / RANK), adapted)]:
        for i, (prompt, tokens) in enumerate(zip(prompts, got)):
            ref = hf_greedy(model, prompt, MAX_NEW, backend.eos_token_ids)
            compared += assert_greedy_matches(tokens, ref, model, prompt, f"{what} prompt {i}")
    assert compared >= 0.75 * 2 * len(prompts) * MAX_NEW, f"only {compared} tokens compared"
    assert adapted != base, "the adapter changes the greedy output"


@pytest.mark.parametrize("weights_id", ["", "lora"])
def test_sampled_logprobs_equal_a_forward_pass(env, weights_id: str) -> None:
    _, backend, _ = env
    prompts = random_prompts(backend.decoder_config.vocab_size, [3, 11, 24], seed=4, avoid=backend.eos_token_ids)
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=11)
    results = backend.sample([SampleRequest(p, params, num_samples=2, weights_id=weights_id) for p in prompts])
    for prompt, result in zip(prompts, results):
        for seq in result.sequences:
            assert len(seq.tokens) == len(seq.logprobs) >= 1
            expected = completion_logprobs(backend, prompt, seq.tokens, weights_id)
            diff = (torch.tensor(seq.logprobs, dtype=torch.float64) - expected.double()).abs().max().item()
            assert diff <= 1e-4, f"weights {weights_id!r}: max |diff| {diff:.3g}"


def test_samples_of_one_prompt_share_its_prefilled_state(env) -> None:
    """num_samples copies the prompt's state (KV and recurrent) to every sample's row: greedy samples are equal."""
    _, backend, _ = env
    prompts = random_prompts(backend.decoder_config.vocab_size, [9, 30], seed=6, avoid=backend.eos_token_ids)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    results = backend.sample([SampleRequest(p, params, num_samples=3, weights_id="lora") for p in prompts])
    alone = backend.sample([SampleRequest(p, params, weights_id="lora") for p in prompts])
    for result, single in zip(results, alone):
        assert [s.tokens for s in result.sequences] == [single.sequences[0].tokens] * 3


def test_prompt_logprobs_equal_token_logprobs(env) -> None:
    _, backend, _ = env
    prompts = random_prompts(backend.decoder_config.vocab_size, [6, 29], seed=5, avoid=backend.eos_token_ids)
    results = backend.sample([SampleRequest(p, SamplingParams(max_tokens=1, temperature=0.0), prompt_logprobs=True,
                                            weights_id="lora") for p in prompts])
    for prompt, result in zip(prompts, results):
        (expected,) = backend.token_logprobs([prompt[:-1]], [prompt[1:]], ["lora"])
        got = torch.tensor(result.prompt_logprobs[1:], dtype=torch.float64)
        # float32 relative: with this strong adapter Qwen3.5's logprobs reach ~12, and both paths are ~4e-5 off a
        # float64 transformers forward (measured), so they may differ by that much from each other.
        tolerance = 1e-5 * max(1.0, expected.abs().max().item())
        assert (got - expected.double()).abs().max().item() <= tolerance
