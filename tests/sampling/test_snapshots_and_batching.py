"""Frozen adapter snapshots (incl. LRU eviction beyond max_resident_snapshots) and continuous batching."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from sampling_reference import (
    assert_same_sequences,
    greedy,
    greedy_requests,
    random_lora_weights,
    random_prompts,
    run_continuous,
    sft_datum,
    train,
)

from skyrl_tx.backend.native import NativeBackend
from skyrl_tx.config import BackendSettings
from skyrl_tx.errors import ConflictError, InvalidArgumentError, NotFoundError
from skyrl_tx.types import SampleRequest, SampleResult, SamplingParams

PRESET = "tiny-qwen3"
MAX_NEW = 10


@pytest.fixture(scope="module")
def path(tiny_model_dir) -> Path:
    return tiny_model_dir(PRESET)


def make_backend(path: Path, **settings) -> NativeBackend:
    return NativeBackend(path, BackendSettings(max_lora_adapters=2, max_lora_rank=8, **settings))


def probe_requests(backend: NativeBackend, weights_id: str) -> list[SampleRequest]:
    """Greedy continuations of two prompts and a seeded temperature-1 sample; the first also asks for prompt
    logprobs (the snapshot's distribution, not only its argmax)."""
    vocab = backend.decoder_config.vocab_size
    p1, p2 = random_prompts(vocab, [7, 19], seed=40, avoid=backend.eos_token_ids)
    return [SampleRequest(p1, greedy(MAX_NEW), weights_id=weights_id, prompt_logprobs=True),
            SampleRequest(p2, greedy(MAX_NEW), weights_id=weights_id),
            SampleRequest(p1, SamplingParams(max_tokens=MAX_NEW, seed=5), num_samples=2, weights_id=weights_id)]


def probe(backend: NativeBackend, weights_id: str) -> list[SampleResult]:
    return backend.sample(probe_requests(backend, weights_id))


def assert_same_probe(actual: list[SampleResult], expected: list[SampleResult], what: str) -> None:
    for i, (a, b) in enumerate(zip(actual, expected, strict=True)):
        assert_same_sequences(a.sequences, b.sequences, f"{what} request {i}")
    pa, pb = actual[0].prompt_logprobs, expected[0].prompt_logprobs
    assert pa[0] is None and pb[0] is None
    assert max(abs(x - y) for x, y in zip(pa[1:], pb[1:])) <= 1e-5, f"{what}: prompt logprobs differ"


def tokens_of(results: list[SampleResult]) -> list[list[list[int]]]:
    return [[s.tokens for s in r.sequences] for r in results]


def train_some(backend: NativeBackend, model_id: str, seed: int, steps: int = 3) -> None:
    vocab = backend.decoder_config.vocab_size
    prompts, completions = random_prompts(vocab, [6, 9], seed), random_prompts(vocab, [8, 5], seed + 1)
    data = [sft_datum(p, c) for p, c in zip(prompts, completions)]
    train(backend, model_id, data, steps=steps, lr=5e-2)


def test_snapshots_freeze_the_adapter(path: Path) -> None:
    backend = make_backend(path)
    backend.create_model("live", lora_rank=4, alpha=8.0)
    random_lora_weights(backend, "live", seed=1)
    at_v1 = probe(backend, "live")
    assert at_v1[0].prompt_logprobs[0] is None
    backend.snapshot("live", "v1")
    train_some(backend, "live", seed=2)
    at_v2 = probe(backend, "live")
    assert tokens_of(at_v2) != tokens_of(at_v1), "training must change the live adapter's samples"
    backend.snapshot("live", "v2")

    v1, v2 = probe(backend, "v1"), probe(backend, "v2")
    assert_same_probe(v1, at_v1, "v1 vs the live adapter at v1 time")
    assert_same_probe(v2, at_v2, "v2 vs the live adapter at v2 time")
    assert tokens_of(v1) != tokens_of(v2)

    train_some(backend, "live", seed=3)
    live_now = probe(backend, "live")
    assert tokens_of(live_now) != tokens_of(v2), "the live adapter moved on"
    # Snapshots ignore later training; v1, v2 and live sampled in one batch.
    mixed = backend.sample(probe_requests(backend, "v2") + probe_requests(backend, "live") +
                           probe_requests(backend, "v1"))
    assert_same_probe(mixed[6:], at_v1, "v1 after more training")
    assert_same_probe(mixed[:3], at_v2, "v2 after more training")
    assert_same_probe(mixed[3:6], live_now, "live in the mixed batch")
    # The snapshot's distribution equals the training-side logprobs of the weights it froze.
    prompt = probe_requests(backend, "v1")[0].prompt_tokens
    (base_lp,) = backend.token_logprobs([prompt[:-1]], [prompt[1:]], [""])
    assert (torch.tensor(mixed[6].prompt_logprobs[1:]) - base_lp).abs().max() > 1e-3, "v1 is not the base model"

    # A snapshot outlives its adapter: the frozen copy is its own.
    backend.remove_model("live")
    assert_same_probe(probe(backend, "v1"), at_v1, "v1 after removing the live adapter")
    backend.remove_snapshot("v2")
    with pytest.raises(NotFoundError):
        probe(backend, "v2")
    with pytest.raises(NotFoundError):
        backend.remove_snapshot("v2")


def test_snapshot_errors(path: Path) -> None:
    backend = make_backend(path)
    backend.create_model("a", lora_rank=2, alpha=2.0)
    backend.snapshot("a", "s")
    with pytest.raises(ConflictError):
        backend.snapshot("a", "s")  # id taken
    with pytest.raises(ConflictError):
        backend.snapshot("a", "a")  # a live model's id
    with pytest.raises(NotFoundError):
        backend.snapshot("missing", "s2")
    with pytest.raises((InvalidArgumentError, NotFoundError)):
        backend.snapshot("", "s3")  # the base model is not an adapter
    with pytest.raises(NotFoundError):
        backend.remove_snapshot("never")


def test_lru_eviction_keeps_every_snapshot_usable(path: Path) -> None:
    """max_resident_snapshots=2 and three snapshots: used in turn (and all in one batch), each keeps giving its
    own output; evicted ones come back from host memory, no error."""
    backend = make_backend(path, max_resident_snapshots=2)
    backend.create_model("live", lora_rank=4, alpha=8.0)
    random_lora_weights(backend, "live", seed=11)
    refs = {}
    for i, sid in enumerate(["s1", "s2", "s3"]):
        if i:
            train_some(backend, "live", seed=20 + i)
        refs[sid] = probe(backend, "live")
        backend.snapshot("live", sid)
    assert len({str(tokens_of(r)) for r in refs.values()}) == 3, "the three snapshots must sample differently"
    train_some(backend, "live", seed=30)
    for sid in ["s1", "s2", "s3", "s1", "s3", "s2", "s1"]:
        assert_same_probe(probe(backend, sid), refs[sid], f"{sid} in turn")
    # All three at once: one must wait for a resident slot inside the same sample() call.
    batch = backend.sample(probe_requests(backend, "s3") + probe_requests(backend, "s1") +
                           probe_requests(backend, "s2"))
    for k, sid in enumerate(["s3", "s1", "s2"]):
        assert_same_probe(batch[3 * k:3 * k + 3], refs[sid], f"{sid} in a batch of three snapshots")


def test_short_requests_overtake_a_long_one(path: Path) -> None:
    backend = make_backend(path, max_sampling_sequences=8)
    vocab = backend.decoder_config.vocab_size
    prompts = random_prompts(vocab, [12, 3, 8, 5, 6], seed=50, avoid=backend.eos_token_ids)
    long_req = SampleRequest(prompts[0], greedy(40))
    short = [SampleRequest(p, greedy(3)) for p in prompts[1:4]]
    results, finished_at = run_continuous(backend, [long_req] + short)
    assert len(results[0].sequences[0].tokens) == 40 and results[0].sequences[0].stop_reason == "length"
    for i in (1, 2, 3):
        assert results[i].sequences[0].stop_reason == "length"
        assert finished_at[i] < finished_at[0], f"short request {i} waited for the long one: {finished_at}"
        assert finished_at[i] <= 3, f"3 tokens take at most 3 steps, took {finished_at[i]}"
    assert finished_at[0] >= 20

    # Requests joining a running batch: submitted while the long one is halfway, they still finish first.
    long_id = backend.submit_sample(long_req)
    for _ in range(10):
        assert backend.sample_step() == []
    late = {backend.submit_sample(r): i for i, r in enumerate(short + [SampleRequest(prompts[4], greedy(2))])}
    done, steps, long_done_at = {}, 0, None
    while long_done_at is None:
        steps += 1
        for rid, result in backend.sample_step():
            if rid == long_id:
                long_done_at = steps
                assert_same_sequences(result.sequences, results[0].sequences, "long request, second run")
            else:
                done[late[rid]] = (steps, result)
    assert sorted(done) == [0, 1, 2, 3], "every late request finished before the long one"
    assert all(step <= 3 for step, _ in done.values()), done
    for i, (_, result) in done.items():
        if i < 3:
            assert_same_sequences(result.sequences, results[i + 1].sequences, f"late short request {i}")
    assert backend.sample_step() == []


def test_more_requests_than_rows_all_complete(path: Path) -> None:
    backend = make_backend(path, max_sampling_sequences=2)
    backend.create_model("a", lora_rank=4, alpha=8.0)
    random_lora_weights(backend, "a", seed=60)
    vocab = backend.decoder_config.vocab_size
    prompts = random_prompts(vocab, [4, 15, 1, 9, 22], seed=61, avoid=backend.eos_token_ids)
    max_new = 6
    alone = [backend.sample(greedy_requests([p], max_new, w))[0] for p, w in zip(prompts, ["", "a", "", "a", ""])]
    requests = [SampleRequest(p, greedy(max_new), weights_id=w) for p, w in zip(prompts, ["", "a", "", "a", ""])]

    batched = backend.sample(requests)  # blocking API: 5 requests through 2 KV rows
    assert len(batched) == 5
    for i, (got, ref) in enumerate(zip(batched, alone)):
        assert_same_sequences(got.sequences, ref.sequences, f"request {i} (sample)")
        assert len(got.sequences[0].tokens) == max_new

    results, finished_at = run_continuous(backend, requests)  # continuous API
    for i in range(5):
        assert_same_sequences(results[i].sequences, alone[i].sequences, f"request {i} (submit/step)")
    # With at most 2 sequences decoding at once, 5 sequences of 6 tokens need three waves of >= 5 steps each.
    assert max(finished_at.values()) >= 3 * (max_new - 1), finished_at

    # A multi-sample request that needs both rows waits until they are free, then completes.
    seeded = SampleRequest(prompts[1], SamplingParams(max_tokens=max_new, seed=9), num_samples=2, weights_id="a")
    ref = backend.sample([seeded])[0]
    mixed = backend.sample([requests[0], seeded, requests[2]])
    assert_same_sequences(mixed[1].sequences, ref.sequences, "two-sample request behind others")
    assert_same_sequences(mixed[0].sequences, alone[0].sequences, "request 0 in front of it")
    assert_same_sequences(mixed[2].sequences, alone[2].sequences, "request 2 behind it")
    with pytest.raises(InvalidArgumentError):
        backend.sample([SampleRequest(prompts[0], greedy(2), num_samples=3)])  # can never fit in 2 rows
