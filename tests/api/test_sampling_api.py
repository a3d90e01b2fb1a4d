"""Sampling through the tinker SDK against a live server: determinism, seeds, num_samples, max_tokens, stops,
prompt logprobs against training logprobs, and sampling clients made from saved weights."""

from __future__ import annotations

from typing import Any

import pytest
from sampling_reference import stop_string_case
from tinker import types

BASE_MODEL = "tiny-qwen3"
PROMPT = [5, 17, 300, 42, 7, 99, 1000, 12]
NEVER = "\x01never\x02"


@pytest.fixture(scope="module")
def server_options() -> dict[str, Any]:
    return {"backend_config": {"max_lora_adapters": 16}}


@pytest.fixture(scope="module")
def base_sampler(service_client: Any) -> Any:
    return service_client.create_sampling_client(base_model=BASE_MODEL).result()


def prompt(tokens: list[int] = PROMPT) -> types.ModelInput:
    return types.ModelInput.from_ints(tokens)


def sample(sampler: Any, num_samples: int = 1, tokens: list[int] = PROMPT, **params: Any) -> types.SampleResponse:
    return sampler.sample(prompt(tokens), num_samples, types.SamplingParams(**params)).result()


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})


def forward_logprobs(training_client: Any, tokens: list[int]) -> list[float]:
    out = training_client.forward([datum(tokens)], "cross_entropy").result()
    return out.loss_fn_outputs[0]["logprobs"].tolist()


def train(training_client: Any, steps: int = 2) -> None:
    data = [datum(PROMPT + [3, 4, 5]), datum([11, 12, 13, 14, 15])]
    for _ in range(steps):
        training_client.forward_backward(data, "cross_entropy")
        training_client.optim_step(types.AdamParams(learning_rate=2e-2)).result()


def test_greedy_sampling_is_deterministic(base_sampler: Any) -> None:
    first = sample(base_sampler, 2, max_tokens=8, temperature=0.0)
    second = sample(base_sampler, 1, max_tokens=8, temperature=0.0)
    tokens = [list(s.tokens) for s in first.sequences]
    assert len(tokens[0]) > 0 and all(0 <= t < 2112 for t in tokens[0])
    assert tokens[0] == tokens[1] == list(second.sequences[0].tokens)


def test_num_samples(base_sampler: Any) -> None:
    result = sample(base_sampler, 3, max_tokens=6, temperature=1.0, seed=11)
    assert len(result.sequences) == 3
    assert all(1 <= len(s.tokens) <= 6 for s in result.sequences)
    assert all(s.logprobs is not None and len(s.logprobs) == len(s.tokens) for s in result.sequences)
    assert len({tuple(s.tokens) for s in result.sequences}) > 1, "the samples of one request are all identical"
    assert len({s.sequence_id for s in result.sequences}) == 3


def test_max_tokens_gives_length(base_sampler: Any) -> None:
    for max_tokens in (1, 5):
        (seq,) = sample(base_sampler, 1, max_tokens=max_tokens, temperature=1.0, seed=3, stop=[]).sequences
        assert len(seq.tokens) == max_tokens and seq.stop_reason == "length"


def test_seeded_sampling_is_reproducible(base_sampler: Any) -> None:
    a = sample(base_sampler, 2, max_tokens=8, temperature=1.0, seed=1234, stop=[])
    b = sample(base_sampler, 2, max_tokens=8, temperature=1.0, seed=1234, stop=[])
    c = sample(base_sampler, 2, max_tokens=8, temperature=1.0, seed=4321, stop=[])
    assert [list(s.tokens) for s in a.sequences] == [list(s.tokens) for s in b.sequences]
    for x, y in zip(a.sequences, b.sequences):
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-6)
    assert [list(s.tokens) for s in a.sequences] != [list(s.tokens) for s in c.sequences]


def test_stop_token_ids(base_sampler: Any) -> None:
    (full,) = sample(base_sampler, 1, max_tokens=12, temperature=1.0, seed=5, stop=[]).sequences
    assert full.stop_reason == "length"
    j = next(i for i in range(2, len(full.tokens)) if full.tokens[i] not in full.tokens[:i])
    (cut,) = sample(base_sampler, 1, max_tokens=12, temperature=1.0, seed=5, stop=[full.tokens[j]]).sequences
    assert list(cut.tokens) == list(full.tokens[:j + 1]) and cut.stop_reason == "stop"


def test_stop_strings(service_client: Any) -> None:
    training_client = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=1).result()
    tokenizer = training_client.get_tokenizer()
    sampler = service_client.create_sampling_client(base_model=BASE_MODEL).result()
    (full,) = sample(sampler, 1, max_tokens=24, temperature=1.0, seed=31, stop=[]).sequences
    assert full.stop_reason == "length"
    s, cut = stop_string_case(tokenizer, list(full.tokens))
    for stop in ([s], [NEVER, s]):
        (seq,) = sample(sampler, 1, max_tokens=24, temperature=1.0, seed=31, stop=stop).sequences
        assert list(seq.tokens) == list(full.tokens[:cut + 1]), f"stop={stop!r}: expected {cut + 1} tokens"
        assert seq.stop_reason == "stop"
    (seq,) = sample(sampler, 1, max_tokens=24, temperature=1.0, seed=31, stop=[NEVER]).sequences
    assert list(seq.tokens) == list(full.tokens) and seq.stop_reason == "length"


def test_prompt_logprobs_equal_training_logprobs(service_client: Any, base_sampler: Any) -> None:
    lps = base_sampler.compute_logprobs(prompt()).result()
    assert len(lps) == len(PROMPT) and lps[0] is None and all(isinstance(x, float) for x in lps[1:])
    # a fresh LoRA adapter has B = 0: its training forward is the base model
    training_client = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=2).result()
    assert lps[1:] == pytest.approx(forward_logprobs(training_client, PROMPT), abs=1e-4)
    # the same through sample(include_prompt_logprobs=True)
    res = base_sampler.sample(prompt(), 1, types.SamplingParams(max_tokens=2, temperature=0.0),
                              include_prompt_logprobs=True).result()
    assert res.prompt_logprobs is not None and res.prompt_logprobs[0] is None
    assert res.prompt_logprobs[1:] == pytest.approx(lps[1:], abs=1e-5)


def test_named_sampler_weights_serve_the_trained_adapter(service_client: Any, base_sampler: Any) -> None:
    training_client = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=3).result()
    train(training_client)
    saved = training_client.save_weights_for_sampler("e2e-ckpt").result()
    assert saved.path == f"tinker://{training_client.model_id}/sampler_weights/e2e-ckpt"
    sampler = service_client.create_sampling_client(model_path=saved.path).result()
    assert sampler.get_base_model() == BASE_MODEL

    trained = forward_logprobs(training_client, PROMPT)
    lps = sampler.compute_logprobs(prompt()).result()
    assert lps[1:] == pytest.approx(trained, abs=1e-4)
    base = base_sampler.compute_logprobs(prompt()).result()
    assert max(abs(a - b) for a, b in zip(lps[1:], base[1:])) > 1e-3, "the sampler serves the base model"
    (seq,) = sample(sampler, 1, max_tokens=4, temperature=0.0, stop=[]).sequences
    assert len(seq.tokens) == 4


def test_sampling_client_snapshot_is_frozen(service_client: Any) -> None:
    training_client = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=4).result()
    train(training_client, steps=1)
    sampler = training_client.save_weights_and_get_sampling_client().result()
    snapshot_lps = sampler.compute_logprobs(prompt()).result()
    assert snapshot_lps[1:] == pytest.approx(forward_logprobs(training_client, PROMPT), abs=1e-4)
    train(training_client, steps=1)
    assert sampler.compute_logprobs(prompt()).result()[1:] == pytest.approx(snapshot_lps[1:], abs=1e-6)
    newer = training_client.save_weights_and_get_sampling_client().result()
    newer_lps = newer.compute_logprobs(prompt()).result()
    assert newer_lps[1:] == pytest.approx(forward_logprobs(training_client, PROMPT), abs=1e-4)
    assert max(abs(a - b) for a, b in zip(newer_lps[1:], snapshot_lps[1:])) > 1e-3


def test_inflight_clients_follow_the_newest_inflight_save(service_client: Any) -> None:
    training_client = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=6).result()
    train(training_client, steps=1)
    first = training_client.save_weights_and_get_sampling_client(kind="inflight").result()
    frozen = training_client.save_weights_and_get_sampling_client().result()  # a snapshot of the same weights
    w1 = first.compute_logprobs(prompt()).result()
    assert w1[1:] == pytest.approx(forward_logprobs(training_client, PROMPT), abs=1e-4)
    train(training_client, steps=1)  # training alone publishes nothing: the inflight target moves on a save
    assert first.compute_logprobs(prompt()).result()[1:] == pytest.approx(w1[1:], abs=1e-6)
    second = training_client.save_weights_and_get_sampling_client(kind="inflight").result()
    w2 = forward_logprobs(training_client, PROMPT)
    assert max(abs(a - b) for a, b in zip(w2, w1[1:])) > 1e-3
    for client in (first, second):  # the client returned before the save sees it too
        assert client.compute_logprobs(prompt()).result()[1:] == pytest.approx(w2, abs=1e-4)
    assert frozen.compute_logprobs(prompt()).result()[1:] == pytest.approx(w1[1:], abs=1e-6)


@pytest.mark.parametrize("fields, named", [({"kind": "mutable"}, "kind must be"),
                                           ({"kind": "inflight", "path": "x"}, "unnamed"),
                                           ({"kind": "inflight", "ttl_seconds": 7200}, "ttl_seconds")])
def test_sampler_save_kinds_are_checked(service_client: Any, http: Any, fields: dict, named: str) -> None:
    model_id = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4).result().model_id
    body = {"model_id": model_id, "seq_id": 1, "sampling_session_seq_id": 0, **fields}
    if "path" in fields:
        del body["sampling_session_seq_id"]
    r = http.post("/api/v1/save_weights_for_sampler", json=body)
    assert r.status_code == 400 and named in r.json()["message"], r.text


def test_topk_prompt_logprobs(base_sampler: Any) -> None:
    k = 3
    res = base_sampler.sample(prompt(), 1, types.SamplingParams(max_tokens=1, temperature=0.0),
                              include_prompt_logprobs=True, topk_prompt_logprobs=k).result()
    topk, lps = res.topk_prompt_logprobs, res.prompt_logprobs
    assert topk is not None and lps is not None and len(topk) == len(lps) == len(PROMPT)
    assert topk[0] is None
    for i, row in enumerate(topk[1:], start=1):
        assert row is not None and len(row) == k
        values = [lp for _, lp in row]
        assert values == sorted(values, reverse=True)
        assert all(0 <= t < 2112 for t, _ in row)
        assert values[0] >= lps[i] - 1e-5  # the best token is at least as likely as the prompt's own
        if PROMPT[i] in [t for t, _ in row]:
            assert dict(row)[PROMPT[i]] == pytest.approx(lps[i], abs=1e-5)
