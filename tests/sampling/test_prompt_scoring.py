"""SDK 0.38's sampling fields in the core, against Hugging Face (+ PEFT) forward passes: top-k logprobs of sampled
positions, prompt_logprobs_last_n, target_prompt_logprobs and prompt alternative draws (prompt_alt_tokens_k)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from sampling_reference import hf_next_logits, peft_from_state, random_lora_weights, random_prompts

from skyrl_tx.backend.native import NativeBackend
from skyrl_tx.config import BackendSettings
from skyrl_tx.errors import InvalidArgumentError
from skyrl_tx.types import SampleRequest, SamplingParams

ADAPTER, RANK, ALPHA = "scores-lora", 4, 8.0
MANY_DRAWS = 2000  # alternative draws per position in the distribution test (max_logprobs_k raised to allow it)


@pytest.fixture(scope="module")
def setup(tiny_model_dir) -> dict[str, Any]:
    from hf_reference import load_hf_model

    path: Path = tiny_model_dir("tiny-qwen3")
    backend = NativeBackend(path, BackendSettings(max_lora_adapters=2, max_lora_rank=8, max_logprobs_k=MANY_DRAWS))
    backend.create_model(ADAPTER, lora_rank=RANK, alpha=ALPHA)
    state = random_lora_weights(backend, ADAPTER, seed=5, scale=0.2)
    models = {"": load_hf_model(path), ADAPTER: peft_from_state(path, state, rank=RANK, alpha=ALPHA)}
    return {"backend": backend, "models": models}


def reference_logprobs(setup: dict[str, Any], weights_id: str, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab] log-softmax; row t is the distribution of token t + 1."""
    return torch.log_softmax(hf_next_logits(setup["models"][weights_id], tokens), -1)


def prompt_of(setup: dict[str, Any], length: int, seed: int) -> list[int]:
    backend = setup["backend"]
    return random_prompts(backend.decoder_config.vocab_size, [length], seed, avoid=backend.eos_token_ids)[0]


@pytest.mark.parametrize("weights_id", ["", ADAPTER])
def test_topk_sample_logprobs_are_the_forward_pass_top_k(setup: dict[str, Any], weights_id: str) -> None:
    backend, k = setup["backend"], 5
    prompt = prompt_of(setup, 7, seed=1)
    asking = SampleRequest(prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=4), num_samples=2,
                           weights_id=weights_id, topk_sample_logprobs=k)
    other = SampleRequest(prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=4), weights_id=weights_id)
    mine, theirs = backend.sample([asking, other])  # decoded in the same steps: k only where asked
    assert all(s.topk_logprobs is None for s in theirs.sequences)
    for seq in mine.sequences:
        assert seq.topk_logprobs is not None and len(seq.topk_logprobs) == len(seq.tokens)
        ref = reference_logprobs(setup, weights_id, prompt + seq.tokens)
        for i, alternatives in enumerate(seq.topk_logprobs):
            want_values, want_ids = ref[len(prompt) - 1 + i].topk(k)
            assert [t for t, _ in alternatives] == want_ids.tolist(), f"step {i}: top-{k} ids"
            assert [lp for _, lp in alternatives] == pytest.approx(want_values.tolist(), abs=1e-4)
            assert seq.logprobs[i] == pytest.approx(ref[len(prompt) - 1 + i, seq.tokens[i]].item(), abs=1e-4)
    assert theirs.sequences[0].tokens == mine.sequences[0].tokens  # asking for k never changes what is drawn


@pytest.mark.parametrize("weights_id", ["", ADAPTER])
def test_prompt_logprobs_last_n_scores_only_the_tail(setup: dict[str, Any], weights_id: str) -> None:
    backend, prompt, n = setup["backend"], prompt_of(setup, 11, seed=2), 4
    (full,) = backend.sample([SampleRequest(prompt, SamplingParams(max_tokens=1, temperature=0.0),
                                            weights_id=weights_id, prompt_logprobs=True, topk_prompt_logprobs=3)])
    (tail,) = backend.sample([SampleRequest(prompt, SamplingParams(max_tokens=1, temperature=0.0),
                                            weights_id=weights_id, prompt_logprobs=True, topk_prompt_logprobs=3,
                                            prompt_logprobs_last_n=n)])
    assert tail.prompt_logprobs[:-n] == [None] * (len(prompt) - n)
    assert tail.topk_prompt_logprobs[:-n] == [None] * (len(prompt) - n)
    assert tail.prompt_logprobs[-n:] == pytest.approx(full.prompt_logprobs[-n:], abs=1e-5)
    for got, want in zip(tail.topk_prompt_logprobs[-n:], full.topk_prompt_logprobs[-n:]):
        assert [t for t, _ in got] == [t for t, _ in want]
    ref = reference_logprobs(setup, weights_id, prompt)
    want = ref[:-1].gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)[-n:]
    assert tail.prompt_logprobs[-n:] == pytest.approx(want.tolist(), abs=1e-4)


@pytest.mark.parametrize("weights_id", ["", ADAPTER])
def test_target_prompt_logprobs_are_the_named_ids_logprobs(setup: dict[str, Any], weights_id: str) -> None:
    backend, prompt = setup["backend"], prompt_of(setup, 9, seed=3)
    vocab = backend.decoder_config.vocab_size
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, vocab, (len(prompt) - 1, 3), generator=gen)  # [P - 1, K]
    ids[torch.rand(ids.shape, generator=gen) < 0.4] = -1
    ids[0] = -1  # a row asking nothing
    (res,) = backend.sample([SampleRequest(prompt, SamplingParams(max_tokens=1), weights_id=weights_id,
                                           target_prompt_token_ids=ids.tolist())])
    ref = reference_logprobs(setup, weights_id, prompt)[:-1]  # [P - 1, V]
    want = torch.where(ids >= 0, ref.gather(1, ids.clamp_min(0)), torch.zeros(()))
    got = torch.tensor(res.target_prompt_logprobs)
    assert got.shape == ids.shape
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    assert (got[ids < 0] == 0).all()


@pytest.mark.parametrize("weights_id", ["", ADAPTER])
def test_greedy_alternative_draws_are_the_argmax(setup: dict[str, Any], weights_id: str) -> None:
    backend, prompt, k = setup["backend"], prompt_of(setup, 8, seed=4), 3
    (res,) = backend.sample([SampleRequest(prompt, SamplingParams(max_tokens=1, temperature=0.0),
                                           weights_id=weights_id, prompt_alt_tokens_k=k)])
    tokens, logprobs = (torch.tensor(x) for x in res.prompt_alt_tokens)  # [P - 1, k] each
    ref = reference_logprobs(setup, weights_id, prompt)[:-1]
    assert tokens.shape == (len(prompt) - 1, k)
    assert (tokens == ref.argmax(-1, keepdim=True)).all()
    assert torch.allclose(logprobs, ref.gather(1, tokens), atol=1e-4)


def test_alternative_draws_follow_the_tempered_distribution(setup: dict[str, Any]) -> None:
    """Many draws at a low temperature (a peaked distribution) match softmax(logits / T) frequency by frequency,
    and each draw's logprob is the unmodified model's."""
    backend, prompt, temperature = setup["backend"], prompt_of(setup, 4, seed=5), 0.03
    params = SamplingParams(max_tokens=1, temperature=temperature, seed=21)
    (res,) = backend.sample([SampleRequest(prompt, params, prompt_alt_tokens_k=MANY_DRAWS)])
    tokens, logprobs = (torch.tensor(x) for x in res.prompt_alt_tokens)
    logits = hf_next_logits(setup["models"][""], prompt)[:-1]  # [P - 1, V]
    assert torch.allclose(logprobs, torch.log_softmax(logits, -1).gather(1, tokens), atol=1e-4)
    probs = torch.softmax(logits / temperature, -1)
    for row in range(len(prompt) - 1):
        counts = torch.bincount(tokens[row], minlength=probs.size(1)).double() / MANY_DRAWS
        likely = probs[row] > 0.02
        assert likely.sum() >= 2, "the test needs a distribution with several likely tokens"
        bound = 5 * torch.sqrt(probs[row] * (1 - probs[row]) / MANY_DRAWS) + 1e-3
        assert ((counts - probs[row]).abs() <= bound).all(), f"row {row}: frequencies off"
    # Seeded: the same draws again, whatever else the request or its batch asks.
    again = backend.sample([SampleRequest(prompt_of(setup, 6, seed=9), params, prompt_alt_tokens_k=3),
                            SampleRequest(prompt, params, prompt_alt_tokens_k=MANY_DRAWS, prompt_logprobs=True,
                                          topk_sample_logprobs=2)])[1]
    assert again.prompt_alt_tokens[0] == res.prompt_alt_tokens[0]
    other_seed = backend.sample([SampleRequest(prompt, SamplingParams(max_tokens=1, temperature=temperature, seed=22),
                                               prompt_alt_tokens_k=MANY_DRAWS)])[0]
    assert other_seed.prompt_alt_tokens[0] != res.prompt_alt_tokens[0]


def test_asking_for_scores_leaves_the_samples_unchanged(setup: dict[str, Any]) -> None:
    backend, prompt = setup["backend"], prompt_of(setup, 6, seed=6)
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=8)
    (plain,) = backend.sample([SampleRequest(prompt, params, num_samples=2)])
    (scored,) = backend.sample([SampleRequest(prompt, params, num_samples=2, prompt_alt_tokens_k=4,
                                              target_prompt_token_ids=[[1]] * (len(prompt) - 1),
                                              topk_sample_logprobs=2)])
    assert [s.tokens for s in scored.sequences] == [s.tokens for s in plain.sequences]


@pytest.mark.parametrize("fields,message", [
    ({"topk_sample_logprobs": MANY_DRAWS + 1}, "topk_sample_logprobs must be in"),
    ({"prompt_alt_tokens_k": -1}, "prompt_alt_tokens_k must be in"),
    ({"prompt_logprobs_last_n": 2}, "prompt_logprobs_last_n applies to prompt logprobs"),
    ({"prompt_logprobs": True, "prompt_logprobs_last_n": 5}, r"prompt_logprobs_last_n must be in \[1, len"),
    ({"target_prompt_token_ids": [[1, 2]] * 3}, "must have shape"),
    ({"target_prompt_token_ids": [[1], [10**6], [-1], [2]]}, "outside"),
    ({"target_prompt_token_ids": [[1], [-2], [-1], [2]]}, "outside"),
])
def test_bad_scoring_options_are_refused_naming_the_field(setup: dict[str, Any], fields: dict, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        setup["backend"].sample([SampleRequest([5, 6, 7, 8, 9], SamplingParams(max_tokens=1), **fields)])


def test_a_default_server_caps_k_at_twenty(tiny_model_dir) -> None:
    backend = NativeBackend(tiny_model_dir("tiny-qwen3"), BackendSettings())
    (res,) = backend.sample([SampleRequest([5, 6, 7], SamplingParams(max_tokens=1), topk_prompt_logprobs=20)])
    assert all(math.isfinite(lp) for _, lp in res.topk_prompt_logprobs[1])
    with pytest.raises(InvalidArgumentError, match="max_logprobs_k"):
        backend.sample([SampleRequest([5, 6, 7], SamplingParams(max_tokens=1), topk_prompt_logprobs=21)])
