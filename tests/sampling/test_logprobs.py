"""Sampled-token logprobs, prompt logprobs and top-k prompt logprobs agree with the training-side forward."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from sampling_reference import completion_logprobs, random_lora_weights, random_prompts

from skyrl_tx.backend.native import NativeBackend
from skyrl_tx.config import BackendSettings
from skyrl_tx.types import SampleRequest, SamplingParams

PRESETS = ["tiny-qwen3", "tiny-llama3"]
ADAPTER = "lp-lora"


@pytest.fixture(scope="module", params=PRESETS)
def backend(request: pytest.FixtureRequest, tiny_model_dir) -> NativeBackend:
    path: Path = tiny_model_dir(request.param)
    backend = NativeBackend(path, BackendSettings(max_lora_adapters=2, max_lora_rank=8))
    backend.create_model(ADAPTER, lora_rank=4, alpha=8.0)
    random_lora_weights(backend, ADAPTER, seed=3, scale=0.2)
    return backend


def assert_close(actual, expected, atol: float, what: str) -> None:
    actual, expected = torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    diff = (actual - expected).abs().max().item()
    assert diff <= atol, f"{what}: max |diff| {diff:.3g} > {atol}"


PARAMS = {
    "temperature-1": SamplingParams(max_tokens=12, temperature=1.0, seed=11),
    "hot-top-k": SamplingParams(max_tokens=12, temperature=1.7, top_k=4, seed=12),
    "top-p": SamplingParams(max_tokens=12, temperature=0.6, top_p=0.3, seed=13),
    "greedy": SamplingParams(max_tokens=12, temperature=0.0),
}


@pytest.mark.parametrize("weights_id", ["", ADAPTER])
def test_sampled_logprobs_are_the_unmodified_distribution(backend: NativeBackend, weights_id: str) -> None:
    """Whatever temperature / top-k / top-p shaped the choice, the reported logprob is log p under the model."""
    prompts = random_prompts(backend.decoder_config.vocab_size, [3, 11, 24, 1], seed=4,
                             avoid=backend.eos_token_ids)
    names = list(PARAMS)
    requests = [SampleRequest(p, PARAMS[name], num_samples=2, weights_id=weights_id)
                for p, name in zip(prompts, names)]
    results = backend.sample(requests)  # one batch, every parameterisation at once
    for prompt, name, result in zip(prompts, names, results):
        assert len(result.sequences) == 2
        for seq in result.sequences:
            assert len(seq.tokens) == len(seq.logprobs) >= 1
            expected = completion_logprobs(backend, prompt, seq.tokens, weights_id)
            assert_close(seq.logprobs, expected, 1e-4, f"{name} weights {weights_id!r}")
            # Sanity of the premise: near-uniform tiny models, so a top-k-4 renormalised logprob (>= log 1/4 on
            # average) could not pass the comparison above by accident.
            assert sum(seq.logprobs) / len(seq.logprobs) < -3.0


def test_prompt_logprobs_match_token_logprobs(backend: NativeBackend) -> None:
    prompts = random_prompts(backend.decoder_config.vocab_size, [2, 9, 30], seed=5)
    for weights_id in ["", ADAPTER]:
        results = backend.sample([SampleRequest(p, SamplingParams(max_tokens=2, temperature=0.0), weights_id=weights_id,
                                                prompt_logprobs=True) for p in prompts])
        for prompt, result in zip(prompts, results):
            lp = result.prompt_logprobs
            assert lp is not None and len(lp) == len(prompt)
            assert lp[0] is None
            assert all(isinstance(x, float) and math.isfinite(x) for x in lp[1:])
            (expected,) = backend.token_logprobs([prompt[:-1]], [prompt[1:]], [weights_id])
            assert_close(lp[1:], expected, 1e-5, f"prompt logprobs (weights {weights_id!r}, len {len(prompt)})")
            assert result.topk_prompt_logprobs is None, "not asked for"


def test_prompt_logprobs_of_adapter_differ_from_base(backend: NativeBackend) -> None:
    prompt = random_prompts(backend.decoder_config.vocab_size, [16], seed=6)[0]
    base, adapted = (backend.sample([SampleRequest(prompt, SamplingParams(max_tokens=1), weights_id=w,
                                                   prompt_logprobs=True)])[0].prompt_logprobs for w in ["", ADAPTER])
    assert max(abs(a - b) for a, b in zip(base[1:], adapted[1:])) > 1e-3


def test_no_prompt_logprobs_unless_asked(backend: NativeBackend) -> None:
    (result,) = backend.sample([SampleRequest([5, 6, 7], SamplingParams(max_tokens=1))])
    assert result.prompt_logprobs is None and result.topk_prompt_logprobs is None


def test_single_token_prompt_logprobs(backend: NativeBackend) -> None:
    (result,) = backend.sample([SampleRequest([42], SamplingParams(max_tokens=1), prompt_logprobs=True,
                                              topk_prompt_logprobs=3)])
    assert result.prompt_logprobs == [None]
    assert result.topk_prompt_logprobs == [None]


@pytest.mark.parametrize("k", [1, 5])
def test_topk_prompt_logprobs(backend: NativeBackend, k: int) -> None:
    prompt = random_prompts(backend.decoder_config.vocab_size, [20], seed=7)[0]
    # Make a few prompt tokens the model's own top-1 choice, so "the prompt token is in the top-k" happens.
    for t in (5, 12):
        logits_top = backend.sample([SampleRequest(prompt[:t], SamplingParams(max_tokens=1, temperature=0.0),
                                                   weights_id=ADAPTER)])[0].sequences[0].tokens[0]
        prompt[t] = logits_top
    (result,) = backend.sample([SampleRequest(prompt, SamplingParams(max_tokens=1), weights_id=ADAPTER,
                                              prompt_logprobs=True, topk_prompt_logprobs=k)])
    topk, lp = result.topk_prompt_logprobs, result.prompt_logprobs
    assert topk is not None and len(topk) == len(prompt)
    assert topk[0] is None
    (expected_lp,) = backend.token_logprobs([prompt[:-1]], [prompt[1:]], [ADAPTER])
    assert_close(lp[1:], expected_lp, 1e-5, "prompt logprobs next to top-k")
    hits = 0
    for t in range(1, len(prompt)):
        entry = topk[t]
        assert len(entry) == k, f"position {t}: {len(entry)} entries, expected {k}"
        ids = [i for i, _ in entry]
        values = [v for _, v in entry]
        assert len(set(ids)) == k, f"position {t}: duplicate ids {ids}"
        assert all(0 <= i < backend.decoder_config.vocab_size for i in ids)
        assert values == sorted(values, reverse=True), f"position {t}: not sorted descending: {values}"
        # The actual prompt token: its logprob matches when listed, and is never above the listed best.
        assert values[0] >= lp[t] - 1e-5
        if prompt[t] in ids:
            hits += 1
            assert abs(values[ids.index(prompt[t])] - lp[t]) <= 1e-5, f"position {t}"
        else:
            assert values[-1] >= lp[t] - 1e-5, f"position {t}: unlisted token above the k-th value"
    assert hits >= 2, "the forced top-1 prompt tokens must appear in the lists"
    # Every listed (id, logprob) is the true logprob of that id: score each rank as a target sequence.
    for r in range(k):
        targets = [topk[t][r][0] for t in range(1, len(prompt))]
        (got,) = backend.token_logprobs([prompt[:-1]], [targets], [ADAPTER])
        assert_close([topk[t][r][1] for t in range(1, len(prompt))], got, 1e-5, f"rank {r} values")
    # The best entry is the greedy choice after that prefix.
    greedy_next = backend.sample([SampleRequest(prompt[:9], SamplingParams(max_tokens=1, temperature=0.0),
                                                weights_id=ADAPTER)])[0].sequences[0].tokens[0]
    assert topk[9][0][0] == greedy_next
