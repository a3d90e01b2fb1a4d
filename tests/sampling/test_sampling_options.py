"""SamplingParams semantics: seeds, top-k / top-p, num_samples, max_tokens, stop tokens / strings / EOS, errors."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from sampling_reference import (
    assert_greedy_matches,
    assert_same_sequences,
    completion_logprobs,
    greedy,
    hf_greedy,
    peft_from_state,
    random_lora_weights,
    random_prompts,
    sample_one,
    stop_string_case,
)
from transformers import AutoTokenizer

from skyrl_tx.backend.native import NativeBackend
from skyrl_tx.config import BackendSettings
from skyrl_tx.errors import InvalidArgumentError, NotFoundError
from skyrl_tx.types import SampleRequest, SamplingParams

PRESETS = ["tiny-qwen3", "tiny-llama3"]
ADAPTER = "opt-lora"
MAX_LEN = 96  # max_sampling_length of the module's backend
MAX_SEQS = 6  # max_sampling_sequences


@pytest.fixture(scope="module", params=PRESETS)
def preset(request: pytest.FixtureRequest, tiny_model_dir) -> tuple[Path, NativeBackend]:
    path: Path = tiny_model_dir(request.param)
    backend = NativeBackend(path, BackendSettings(max_lora_adapters=3, max_lora_rank=8, max_sampling_length=MAX_LEN,
                                                  max_sampling_sequences=MAX_SEQS,
                                                  max_logprobs_k=1 << 20))  # whole distributions (top-k, k = V)
    backend.create_model(ADAPTER, lora_rank=4, alpha=8.0)
    random_lora_weights(backend, ADAPTER, seed=21, scale=0.2)
    return path, backend


@pytest.fixture(scope="module")
def backend(preset) -> NativeBackend:
    return preset[1]


def prompt_of(backend: NativeBackend, length: int, seed: int) -> list[int]:
    return random_prompts(backend.decoder_config.vocab_size, [length], seed, avoid=backend.eos_token_ids)[0]


# ---- seeds ------------------------------------------------------------------------------------------
SEEDED = SamplingParams(max_tokens=14, temperature=0.9, top_k=200, top_p=0.95, seed=1234)


def test_seeded_request_alone_equals_inside_a_batch(backend: NativeBackend) -> None:
    prompt = prompt_of(backend, 9, seed=1)
    alone = sample_one(backend, prompt, SEEDED, num_samples=2)
    others = [
        SampleRequest(prompt_of(backend, 17, 2), SamplingParams(max_tokens=20, temperature=1.0)),  # unseeded
        SampleRequest(prompt, SamplingParams(max_tokens=5, temperature=0.0)),  # greedy, same prompt
        SampleRequest(prompt_of(backend, 3, 3), SamplingParams(max_tokens=30, temperature=1.3, top_k=7, seed=99),
                      num_samples=2, weights_id=ADAPTER),
        SampleRequest(prompt_of(backend, 25, 4), SamplingParams(max_tokens=8, temperature=0.5, top_p=0.4)),
    ]
    batch = backend.sample(others[:2] + [SampleRequest(prompt, SEEDED, num_samples=2)] + others[2:])
    assert_same_sequences(batch[2].sequences, alone, "seeded: batched vs alone")
    # And a third time, after the batch, on its own again: the same draws (its prompt now comes from the prefix cache,
    # so logprobs agree to float32 rounding, not bit for bit).
    again = backend.sample([SampleRequest(prompt, SEEDED, num_samples=2)])[0]
    assert again.prompt_cache_hit_tokens > 0
    assert_same_sequences(again.sequences, alone, "seeded: alone again, from the prefix cache")


def test_seeded_request_with_adapter_is_reproducible(backend: NativeBackend) -> None:
    prompt = prompt_of(backend, 6, seed=5)
    first = sample_one(backend, prompt, SEEDED, weights_id=ADAPTER)[0]
    noise = [SampleRequest(prompt_of(backend, 11, 6), SamplingParams(max_tokens=12), num_samples=3)]
    second = backend.sample(noise + [SampleRequest(prompt, SEEDED, weights_id=ADAPTER)])[1].sequences[0]
    assert_same_sequences([second], [first], "seeded adapter: batched vs alone")
    # The adapter's distribution, not the base's, was sampled.
    assert first.tokens != sample_one(backend, prompt, SEEDED)[0].tokens


def test_different_seeds_differ(backend: NativeBackend) -> None:
    prompt = prompt_of(backend, 5, seed=7)
    outs = [sample_one(backend, prompt, SamplingParams(max_tokens=16, seed=s))[0].tokens for s in (1, 2, 3)]
    assert outs[0] != outs[1] and outs[1] != outs[2] and outs[0] != outs[2]


def test_unseeded_requests_are_not_all_identical(backend: NativeBackend) -> None:
    prompt = prompt_of(backend, 5, seed=8)
    outs = {tuple(sample_one(backend, prompt, SamplingParams(max_tokens=16))[0].tokens) for _ in range(3)}
    assert len(outs) > 1


# ---- top-k / top-p --------------------------------------------------------------------------------
def test_top_k_1_and_tiny_top_p_equal_greedy(backend: NativeBackend) -> None:
    for weights_id in ["", ADAPTER]:
        prompt = prompt_of(backend, 8, seed=9)
        ref = sample_one(backend, prompt, greedy(15), weights_id)[0]
        for params in (SamplingParams(max_tokens=15, temperature=1.5, top_k=1, seed=4),
                       SamplingParams(max_tokens=15, temperature=1.0, top_p=1e-6, seed=5)):
            got = sample_one(backend, prompt, params, weights_id, num_samples=2)
            for seq in got:
                assert seq.tokens == ref.tokens, f"{params} ({weights_id!r})"
                assert max(abs(a - b) for a, b in zip(seq.logprobs, ref.logprobs)) <= 1e-5


def full_distributions(backend: NativeBackend, prompt: list[int], completion: list[int],
                       weights_id: str) -> list[dict[int, float]]:
    """{token: logprob} over the whole vocabulary before each completion token (top-k prompt logprobs, k = V)."""
    vocab = backend.decoder_config.vocab_size
    full = prompt + completion
    (res,) = backend.sample([SampleRequest(full, SamplingParams(max_tokens=1), weights_id=weights_id,
                                           topk_prompt_logprobs=vocab)])
    return [dict(res.topk_prompt_logprobs[len(prompt) + i]) for i in range(len(completion))]


@pytest.mark.parametrize("weights_id", ["", ADAPTER])
def test_top_k_and_top_p_restrict_the_choice(backend: NativeBackend, weights_id: str) -> None:
    prompt = prompt_of(backend, 4, seed=10)
    k, p = 3, 0.02
    by_k = sample_one(backend, prompt, SamplingParams(max_tokens=10, temperature=2.0, top_k=k, seed=8),
                      weights_id, num_samples=3)
    for seq in by_k:
        for i, dist in enumerate(full_distributions(backend, prompt, seq.tokens, weights_id)):
            above = sum(1 for v in dist.values() if v > dist[seq.tokens[i]] + 1e-5)
            assert above < k, f"top_k={k}: step {i} sampled a token of rank {above}"
    by_p = sample_one(backend, prompt, SamplingParams(max_tokens=10, temperature=1.0, top_p=p, seed=9),
                      weights_id, num_samples=3)
    for seq in by_p:
        for i, dist in enumerate(full_distributions(backend, prompt, seq.tokens, weights_id)):
            lp = dist[seq.tokens[i]]
            before = sum(math.exp(v) for v in dist.values() if v > lp + 1e-5)
            assert before < p + 1e-5, f"top_p={p}: step {i} sampled after {before:.4f} of mass"
    # The cuts are not trivially greedy: the samples vary.
    assert len({tuple(s.tokens) for s in by_k + by_p}) > 2


# ---- num_samples / max_tokens -----------------------------------------------------------------------
def test_num_samples(backend: NativeBackend) -> None:
    prompt = prompt_of(backend, 7, seed=11)
    seeded = sample_one(backend, prompt, SamplingParams(max_tokens=10, seed=5), num_samples=4)
    assert len(seeded) == 4
    assert len({tuple(s.tokens) for s in seeded}) == 4, "samples of one seeded request must differ"
    for s in seeded:
        assert len(s.tokens) == len(s.logprobs) == 10 and s.stop_reason == "length"
    ref = sample_one(backend, prompt, greedy(10))[0]
    for s in sample_one(backend, prompt, greedy(10), num_samples=3):
        assert s.tokens == ref.tokens
    # Several multi-sample requests in one batch: each gets its own count.
    results = backend.sample([SampleRequest(prompt, SamplingParams(max_tokens=3), num_samples=n) for n in (1, 3, 2)])
    assert [len(r.sequences) for r in results] == [1, 3, 2]


@pytest.mark.parametrize("max_tokens", [1, 2, 9, 33])
def test_max_tokens_gives_length(backend: NativeBackend, max_tokens: int) -> None:
    prompt = prompt_of(backend, 5, seed=12)
    for params in (greedy(max_tokens), SamplingParams(max_tokens=max_tokens, seed=3)):
        (seq,) = sample_one(backend, prompt, params)
        assert len(seq.tokens) == len(seq.logprobs) == max_tokens
        assert seq.stop_reason == "length"


def test_prompt_plus_max_tokens_may_fill_max_sampling_length(backend: NativeBackend) -> None:
    prompt = prompt_of(backend, MAX_LEN - 4, seed=13)
    (seq,) = sample_one(backend, prompt, greedy(4))
    assert len(seq.tokens) == 4 and seq.stop_reason == "length"
    assert max(abs(a - b) for a, b in zip(seq.logprobs, completion_logprobs(backend, prompt, seq.tokens))) <= 1e-4


# ---- stop tokens / strings / EOS --------------------------------------------------------------------
def first_new_token_index(tokens: list[int], lo: int, exclude: list[int]) -> int:
    """The first index >= lo whose token did not occur before it (fallback: the first such index at all)."""
    fresh = [j for j, t in enumerate(tokens) if t not in tokens[:j] and t not in exclude]
    later = [j for j in fresh if j >= lo]
    return (later or fresh)[0]


@pytest.mark.parametrize("mode", ["greedy", "seeded"])
def test_stop_token_cuts_after_the_token(backend: NativeBackend, mode: str) -> None:
    prompt = prompt_of(backend, 6, seed=14)
    params = greedy(20) if mode == "greedy" else SamplingParams(max_tokens=20, temperature=1.0, seed=77)
    (full,) = sample_one(backend, prompt, params)
    assert full.stop_reason == "length"
    j = first_new_token_index(full.tokens, 4, backend.eos_token_ids)
    stop_id = full.tokens[j]
    never = next(t for t in range(backend.decoder_config.vocab_size) if t not in full.tokens)
    for stop in ([stop_id], [never, stop_id]):
        params.stop = stop
        (seq,) = sample_one(backend, prompt, params)
        assert seq.tokens == full.tokens[:j + 1], f"stop={stop}"
        assert seq.stop_reason == "stop"
        assert seq.logprobs == pytest.approx(full.logprobs[:j + 1], abs=1e-5)
    params.stop = [never]
    (seq,) = sample_one(backend, prompt, params)
    assert seq.tokens == full.tokens and seq.stop_reason == "length"


@pytest.mark.parametrize("mode", ["greedy", "seeded"])
def test_stop_string_cuts_at_the_completing_token(preset, mode: str) -> None:
    path, backend = preset
    tok = AutoTokenizer.from_pretrained(path)
    prompt = prompt_of(backend, 5, seed=15)
    params = greedy(24) if mode == "greedy" else SamplingParams(max_tokens=24, temperature=1.0, seed=31)
    # llama's tiny greedy output can be one repeated token; sample with the adapter, whose text varies more.
    (full,) = sample_one(backend, prompt, params, ADAPTER)
    assert full.stop_reason == "length"
    s, cut = stop_string_case(tok, full.tokens, min_cut=2)
    for stop in ([s], ["\x01never\x02", s]):
        params.stop = stop
        (seq,) = sample_one(backend, prompt, params, ADAPTER)
        assert seq.tokens == full.tokens[:cut + 1], f"stop={stop!r}: expected {cut + 1} tokens"
        assert seq.stop_reason == "stop"
        assert s in tok.decode(seq.tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    params.stop = ["\x01never\x02"]
    (seq,) = sample_one(backend, prompt, params, ADAPTER)
    assert seq.tokens == full.tokens and seq.stop_reason == "length"


def test_eos_id_as_stop_token(backend: NativeBackend) -> None:
    """EOS ids are stop tokens anyway; listing one in `stop` changes nothing and is accepted."""
    prompt = prompt_of(backend, 6, seed=16)
    ref = sample_one(backend, prompt, greedy(12))[0]
    got = sample_one(backend, prompt, greedy(12, stop=list(backend.eos_token_ids)))[0]
    assert got.tokens == ref.tokens and got.stop_reason == ref.stop_reason


def test_model_eos_stops_generation(preset) -> None:
    """An lm_head-only adapter that raises the EOS logit along a random direction of the final hidden state makes
    the model itself say EOS at varying points. Sampling stops there with "stop" and EOS included once, runs
    without EOS reach max_tokens, and transformers' generate(eos_token_id=...) on a PEFT copy agrees."""
    path, backend = preset
    eos = backend.eos_token_ids
    max_new = 12
    backend.create_model("eos-lora", lora_rank=1, alpha=1.0, train_attn=False, train_mlp=False)
    try:
        state = backend.trainable_state("eos-lora")
        (name_a,) = [k for k in state if ".lora_A." in k]
        (name_b,) = [k for k in state if ".lora_B." in k]
        gen = torch.Generator().manual_seed(0)
        weights = {name_a: torch.randn(state[name_a].shape, generator=gen), name_b: torch.zeros(state[name_b].shape)}
        weights[name_b][eos[0], 0] = 0.1
        backend.set_adapter_weights("eos-lora", weights)
        prompts = random_prompts(backend.decoder_config.vocab_size, [5] * 24, seed=3, avoid=eos)
        results = backend.sample([SampleRequest(p, greedy(max_new), weights_id="eos-lora") for p in prompts])
        stopped, ran = [], []
        for prompt, result in zip(prompts, results):
            (seq,) = result.sequences
            if seq.stop_reason == "stop":
                assert seq.tokens[-1] in eos and not set(seq.tokens[:-1]) & set(eos), seq.tokens
                assert len(seq.tokens) <= max_new
                stopped.append((prompt, seq))
            else:
                assert seq.stop_reason == "length" and len(seq.tokens) == max_new, seq
                assert not set(seq.tokens) & set(eos), f"EOS sampled without stopping: {seq.tokens}"
                ran.append((prompt, seq))
        mid = [(p, s) for p, s in stopped if len(s.tokens) >= 3]
        assert mid and ran, f"expected EOS mid-completion and runs to length: {[len(s.tokens) for _, s in stopped]}"
        peft_model = peft_from_state(path, backend.adapter_state_dict("eos-lora"), rank=1, alpha=1.0,
                                     target_modules=["lm_head"])
        for prompt, seq in mid[:3] + ran[:1]:
            ref = hf_greedy(peft_model, prompt, max_new, eos)
            if assert_greedy_matches(seq.tokens, ref, peft_model, prompt, "eos adapter") == len(ref):
                assert (ref[-1] in eos) == (seq.stop_reason == "stop")
            lp = completion_logprobs(backend, prompt, seq.tokens, "eos-lora")
            assert seq.logprobs == pytest.approx(lp.tolist(), abs=1e-4)
        # Seeded sampling obeys EOS too (the adapter makes EOS likely enough to show up).
        for prompt, _ in mid[:2]:
            for seq in sample_one(backend, prompt, SamplingParams(max_tokens=max_new, temperature=0.3, seed=2),
                                  "eos-lora", num_samples=3):
                if seq.stop_reason == "stop":
                    assert seq.tokens[-1] in eos and not set(seq.tokens[:-1]) & set(eos)
                else:
                    assert len(seq.tokens) == max_new and not set(seq.tokens) & set(eos)
    finally:
        backend.remove_model("eos-lora")


# ---- errors -----------------------------------------------------------------------------------------
BAD_PARAMS = {
    "negative temperature": SamplingParams(temperature=-0.1),
    "top_p 0": SamplingParams(top_p=0.0),
    "top_p above 1": SamplingParams(top_p=1.01),
    "max_tokens 0": SamplingParams(max_tokens=0),
    "stop token out of range": SamplingParams(stop=[10**6]),
    "empty stop string": SamplingParams(stop=[""]),
}


@pytest.mark.parametrize("name", list(BAD_PARAMS))
def test_bad_params_raise_invalid_argument(backend: NativeBackend, name: str) -> None:
    with pytest.raises(InvalidArgumentError):
        backend.sample([SampleRequest([1, 2, 3], BAD_PARAMS[name])])
    with pytest.raises(InvalidArgumentError):
        backend.submit_sample(SampleRequest([1, 2, 3], BAD_PARAMS[name]))


def test_bad_requests_raise(backend: NativeBackend) -> None:
    with pytest.raises(InvalidArgumentError, match="max_sampling_length"):
        backend.sample([SampleRequest(prompt_of(backend, MAX_LEN - 4, 18), greedy(5))])
    with pytest.raises(InvalidArgumentError):
        backend.sample([SampleRequest([1] * (MAX_LEN + 1), greedy(1))])
    with pytest.raises(NotFoundError):
        backend.sample([SampleRequest([1, 2], greedy(2), weights_id="no-such-model")])
    with pytest.raises(NotFoundError):
        backend.submit_sample(SampleRequest([1, 2], greedy(2), weights_id="no-such-snapshot"))
    with pytest.raises(InvalidArgumentError):
        backend.sample([SampleRequest([1, 2], greedy(2), num_samples=MAX_SEQS + 1)])
    with pytest.raises(InvalidArgumentError):
        backend.sample([SampleRequest([1, 2], greedy(2), num_samples=0)])
    with pytest.raises(InvalidArgumentError):
        backend.sample([SampleRequest([], greedy(2))])
    with pytest.raises(InvalidArgumentError):
        backend.sample([SampleRequest([1, backend.decoder_config.vocab_size], greedy(2))])
    with pytest.raises(InvalidArgumentError):
        backend.sample([SampleRequest([1, 2], SamplingParams(stop=[5, "x"]))])
    # Nothing was queued by the rejected requests, and the backend still samples normally.
    assert backend.sample_step() == []
    (seq,) = sample_one(backend, [1, 2, 3], greedy(3))
    assert len(seq.tokens) == 3
