"""Prefix caching in the generator: prompts that start like an earlier prompt (or its completion) reuse its K/V
instead of prefilling it again. Every result must equal a backend without the cache (prefix_caching=false), hits are
reported (prompt_cache_hit_tokens), rows held by the cache are reclaimed when requests need them, and weights that can
change (a live adapter) or are gone (a removed snapshot) are never served from it."""

from __future__ import annotations

from pathlib import Path

import pytest
from sampling_reference import assert_same_sequences, random_lora_weights, random_prompts

from skyrl_tx.backend.native import NativeBackend
from skyrl_tx.config import BackendSettings
from skyrl_tx.types import SampleRequest, SampleResult, SamplingParams

PRESETS = ["tiny-qwen3", "tiny-llama3", "tiny-deepseek-v3"]  # GQA with/without qk-norm, MLA (latent cache)
ADAPTER, SNAPSHOT = "pc-lora", "pc-snapshot"
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
SEEDED = SamplingParams(max_tokens=6, temperature=1.0, seed=17)


def make_backend(path: Path, prefix_caching: bool, rows: int = 16) -> NativeBackend:
    backend = NativeBackend(path, BackendSettings(max_lora_adapters=2, max_lora_rank=8, max_sampling_sequences=rows,
                                                  max_sampling_length=128, prefix_caching=prefix_caching))
    backend.create_model(ADAPTER, lora_rank=4, alpha=8.0)
    random_lora_weights(backend, ADAPTER, seed=3, scale=0.2)
    backend.snapshot(ADAPTER, SNAPSHOT)
    return backend


@pytest.fixture(scope="module", params=PRESETS)
def pair(request: pytest.FixtureRequest, tiny_model_dir) -> tuple[NativeBackend, NativeBackend]:
    path = tiny_model_dir(request.param)
    return make_backend(path, True), make_backend(path, False)


def prompts(backend: NativeBackend, lengths: list[int], seed: int) -> list[list[int]]:
    return random_prompts(backend.decoder_config.vocab_size, lengths, seed, avoid=backend.eos_token_ids)


def logprob_atol(backend: NativeBackend) -> float:
    """1e-5 (float32 across computation orders); MLA 2e-5: its decode attends in the latent space (the absorbed query
    W_UK^T q), where the entries a prefix-cache hit reuses (written by an earlier decode step) and a fresh prefill's
    differ by rounding that a strong snapshot adapter's absorbed query carries further: 1.8e-5 measured, 5.7e-6 when
    decode expanded every latent. Sampled logprobs still equal a forward pass (test_architecture_sampling)."""
    return 2e-5 if backend.decoder_config.kv_lora_rank > 0 else 1e-5


def assert_same(cached: SampleResult, fresh: SampleResult, what: str, atol: float) -> None:
    assert_same_sequences(cached.sequences, fresh.sequences, what, atol=atol)
    for name in ("prompt_logprobs", "target_prompt_logprobs"):
        got, want = getattr(cached, name), getattr(fresh, name)
        assert (got is None) == (want is None), f"{what}: {name}"
        if got is not None:
            flat = lambda rows: [v for r in rows for v in (r if isinstance(r, list) else [r]) if v is not None]  # noqa: E731
            assert flat(got) == pytest.approx(flat(want), abs=1e-5), f"{what}: {name}"


@pytest.mark.parametrize("weights_id", ["", SNAPSHOT])
def test_multi_turn_prompts_hit_the_cache_and_equal_a_fresh_prefill(pair, weights_id: str) -> None:
    cached, fresh = pair
    first = prompts(cached, [9, 12], seed=1)
    turns = {b: b.sample([SampleRequest(p, params, weights_id=weights_id, num_samples=2)
                          for p, params in zip(first, (GREEDY, SEEDED))]) for b in pair}
    for got, want in zip(turns[cached], turns[fresh]):
        assert_same(got, want, "turn 1", logprob_atol(cached))
        assert got.prompt_cache_hit_tokens == 0  # nothing cached yet
    # Another prompt decodes while the finished rows sit in the cache (they ride along in the decode batch).
    other = prompts(cached, [7], seed=2)[0]
    for b in pair:
        b.sample([SampleRequest(other, SEEDED, weights_id=weights_id, num_samples=3)])
    # Turn 2: each conversation goes on from its first sample, plus new user tokens.
    for i, (p, params) in enumerate(zip(first, (GREEDY, SEEDED))):
        history = p + turns[cached][i].sequences[0].tokens + [11, 12, 13]
        (got,) = cached.sample([SampleRequest(history, params, weights_id=weights_id, num_samples=2)])
        (want,) = fresh.sample([SampleRequest(history, params, weights_id=weights_id, num_samples=2)])
        assert_same(got, want, f"turn 2, conversation {i}", logprob_atol(cached))
        # The prompt and every generated token but the last were fed back, so their K/V are cached.
        assert got.prompt_cache_hit_tokens == len(p) + len(turns[cached][i].sequences[0].tokens) - 1
        assert want.prompt_cache_hit_tokens == 0
        # The same prompt again: all but its last token (whose logits start sampling) come from the cache.
        (again,) = cached.sample([SampleRequest(history, params, weights_id=weights_id, num_samples=2)])
        assert_same(again, want, f"turn 2 again, conversation {i}", logprob_atol(cached))
        assert again.prompt_cache_hit_tokens == len(history) - 1


def test_scored_positions_are_computed_not_cached(pair) -> None:
    cached, fresh = pair
    base = prompts(cached, [10], seed=3)[0]
    for b in pair:
        b.sample([SampleRequest(base, GREEDY)])
    longer = base + [21, 22, 23, 24]
    targets = [[-1]] * (len(longer) - 1)
    targets[5] = [7]  # row 5 asks: rows from 5 on must be computed
    asks = [({"prompt_logprobs": True}, 0),  # hits: the cache may serve rows before the first scored one ({"prompt_logprobs": True, "prompt_logprobs_last_n": 3}, len(longer) - 4),
            ({"target_prompt_token_ids": targets}, 5), ({"prompt_alt_tokens_k": 2}, 0),
            ({"topk_prompt_logprobs": 2, "prompt_logprobs_last_n": 2}, len(longer) - 3)]
    for fields, hit in asks:
        (got,) = cached.sample([SampleRequest(longer, GREEDY, **fields)])
        (want,) = fresh.sample([SampleRequest(longer, GREEDY, **fields)])
        assert got.prompt_cache_hit_tokens == hit, fields  # `longer` itself is cached after the first ask
        assert_same(got, want, str(fields), logprob_atol(cached))
        if "prompt_logprobs_last_n" in fields and "topk_prompt_logprobs" in fields:
            assert [r and [t for t, _ in r] for r in got.topk_prompt_logprobs] == \
                [r and [t for t, _ in r] for r in want.topk_prompt_logprobs]


def test_live_adapters_and_removed_snapshots_are_never_served_from_the_cache(tiny_model_dir) -> None:
    path = tiny_model_dir("tiny-qwen3")
    cached, fresh = make_backend(path, True), make_backend(path, False)
    p = prompts(cached, [12], seed=4)[0]
    for weights_id in (ADAPTER, ADAPTER):  # a live adapter's weights may change between calls
        (got,) = cached.sample([SampleRequest(p, GREEDY, weights_id=weights_id)])
        assert got.prompt_cache_hit_tokens == 0
    (warm,) = cached.sample([SampleRequest(p, GREEDY, weights_id=SNAPSHOT)])
    (hit,) = cached.sample([SampleRequest(p, GREEDY, weights_id=SNAPSHOT)])
    assert hit.prompt_cache_hit_tokens == len(p) - 1
    for b in (cached, fresh):  # the same snapshot id, now other weights
        b.remove_snapshot(SNAPSHOT)
        random_lora_weights(b, ADAPTER, seed=9, scale=0.3)
        b.snapshot(ADAPTER, SNAPSHOT)
    (got,) = cached.sample([SampleRequest(p, GREEDY, weights_id=SNAPSHOT)])
    (want,) = fresh.sample([SampleRequest(p, GREEDY, weights_id=SNAPSHOT)])
    assert got.prompt_cache_hit_tokens == 0
    assert_same(got, want, "re-created snapshot", logprob_atol(cached))
    assert got.sequences[0].tokens != warm.sequences[0].tokens or \
        got.sequences[0].logprobs != pytest.approx(warm.sequences[0].logprobs, abs=1e-4)


def test_cached_rows_are_given_back_when_requests_need_them(tiny_model_dir) -> None:
    path = tiny_model_dir("tiny-qwen3")
    cached, fresh = make_backend(path, True, rows=3), make_backend(path, False, rows=3)
    ps = prompts(cached, [6, 7, 8, 9], seed=5)
    for p in ps[:3]:  # three finished requests: every row now holds a cached prefix
        cached.sample([SampleRequest(p, GREEDY)])
    (got,) = cached.sample([SampleRequest(ps[3], SEEDED, num_samples=3)])  # needs all three rows
    (want,) = fresh.sample([SampleRequest(ps[3], SEEDED, num_samples=3)])
    assert_same(got, want, "after eviction", logprob_atol(cached))
    # The most recent entries survive eviction's LRU order where rows allow: the newest prompt hits.
    (again,) = cached.sample([SampleRequest(ps[3] + [5], GREEDY)])
    assert again.prompt_cache_hit_tokens == len(ps[3])


def test_a_request_needing_every_row_is_admitted_when_its_prompt_hits_the_cache(tiny_model_dir) -> None:
    """The hit's row cannot be evicted for the request's other rows; when the request needs every row, the hit's row
    becomes its first (found with rl_loop's default group_size=16 on the default 16 rows: it waited forever)."""
    path = tiny_model_dir("tiny-qwen3")
    cached, fresh = make_backend(path, True, rows=3), make_backend(path, False, rows=3)
    (p,) = prompts(cached, [8], seed=6)
    cached.sample([SampleRequest(p, GREEDY)])  # a row now holds p's prefix
    request = SampleRequest(p, SEEDED, num_samples=3)  # hits it and needs all three rows (a GRPO group)
    sample_id = cached.submit_sample(request)
    done = {}
    for _ in range(4 * SEEDED.max_tokens):  # bounded: a request that is never admitted must not hang the test
        done.update(cached.sample_step())
        if sample_id in done:
            break
    assert sample_id in done, "never admitted"
    (want,) = fresh.sample([request])
    assert_same(done[sample_id], want, "all rows after a hit", logprob_atol(cached))
