"""SDK 0.38's sampling fields through the real tinker SDK against a live server: topk_sample_logprobs,
prompt_logprobs_last_n, target_prompt_logprobs (dense and the cookbook's sparse form), prompt_alt_tokens_k, and the
400s for bad values. The numbers are checked against Hugging Face in tests/sampling/test_prompt_scoring.py; here,
against the server's own prompt scoring of the same tokens (each field must reach the engine and come back)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tinker import types

BASE_MODEL = "tiny-qwen3"
PROMPT = [5, 17, 300, 42, 7, 99, 1000, 12]


@pytest.fixture(scope="module")
def sampler(service_client: Any) -> Any:
    return service_client.create_sampling_client(base_model=BASE_MODEL).result()


def prompt(tokens: list[int] = PROMPT) -> types.ModelInput:
    return types.ModelInput.from_ints(tokens)


def scored(sampler: Any, tokens: list[int], k: int) -> types.SampleResponse:
    return sampler.sample(prompt(tokens), 1, types.SamplingParams(max_tokens=1, temperature=0.0),
                          include_prompt_logprobs=True, topk_prompt_logprobs=k).result()


def test_topk_sample_logprobs_equal_the_prompt_scoring_of_the_same_tokens(sampler: Any) -> None:
    k = 4
    res = sampler.sample(prompt(), 2, types.SamplingParams(max_tokens=5, temperature=1.0, seed=3),
                         topk_sample_logprobs=k).result()
    for seq in res.sequences:
        assert seq.topk_logprobs is not None and len(seq.topk_logprobs) == len(seq.tokens)
        ref = scored(sampler, PROMPT + list(seq.tokens), k)
        for i, alternatives in enumerate(seq.topk_logprobs):
            want = ref.topk_prompt_logprobs[len(PROMPT) + i]
            assert [t for t, _ in alternatives] == [t for t, _ in want]
            assert [lp for _, lp in alternatives] == pytest.approx([lp for _, lp in want], abs=1e-4)
    plain = sampler.sample(prompt(), 1, types.SamplingParams(max_tokens=3, temperature=0.0)).result()
    assert plain.sequences[0].topk_logprobs is None  # not asked: not sent


def test_compute_logprobs_last_n_scores_only_the_tail(sampler: Any) -> None:
    full = sampler.compute_logprobs(prompt()).result()
    last = sampler.compute_logprobs(prompt(), prompt_logprobs_last_n=3).result()
    assert last[:-3] == [None] * (len(PROMPT) - 3)
    assert last[-3:] == pytest.approx(full[-3:], abs=1e-5)
    topk = sampler.sample(prompt(), 1, types.SamplingParams(max_tokens=1), include_prompt_logprobs=True,
                          topk_prompt_logprobs=2, prompt_logprobs_last_n=2).result()
    assert topk.topk_prompt_logprobs[:-2] == [None] * (len(PROMPT) - 2)
    assert all(row is not None and len(row) == 2 for row in topk.topk_prompt_logprobs[-2:])


def test_target_prompt_logprobs_dense_and_sparse(sampler: Any) -> None:
    full = sampler.compute_logprobs(prompt()).result()
    ids = torch.tensor([[t, -1] for t in PROMPT[1:]], dtype=torch.int64)  # [len(prompt) - 1, K]: the actual tokens
    dense = sampler.sample(prompt(), 1, types.SamplingParams(max_tokens=1),
                           target_prompt_logprobs=types.TensorData.from_torch(ids)).result()
    values = dense.target_prompt_logprobs.to_torch()
    assert values.shape == ids.shape
    assert values[:, 0].tolist() == pytest.approx(full[1:], abs=1e-4)
    assert (values[:, 1] == 0).all()
    # The cookbook's `decisions` recipe: one row of label ids, sent as sparse CSR, answered in the same layout.
    labels = [11, PROMPT[5], 42]  # row 4 scores prompt position 5, whose own token is PROMPT[5]
    choice = torch.full((len(PROMPT) - 1, len(labels)), -1, dtype=torch.int64)
    choice[4] = torch.tensor(labels)
    request = types.TensorData.from_torch_sparse(choice, pad_value=-1)
    assert request.sparse_crow_indices is not None, "the test needs the sparse form"
    sparse = sampler.sample(prompt(), 1, types.SamplingParams(max_tokens=1), target_prompt_logprobs=request).result()
    assert sparse.target_prompt_logprobs.sparse_crow_indices == request.sparse_crow_indices
    got = sparse.target_prompt_logprobs.to_torch()  # densified: 0.0 in every unlisted cell
    assert got.shape == choice.shape and (got[choice < 0] == 0).all()
    assert got[4, 1].item() == pytest.approx(full[5], abs=1e-4)
    as_dense = sampler.sample(prompt(), 1, types.SamplingParams(max_tokens=1),
                              target_prompt_logprobs=types.TensorData.from_torch(choice)).result()
    assert got[4].tolist() == pytest.approx(as_dense.target_prompt_logprobs.to_torch()[4].tolist(), abs=1e-6)
    assert len(set(got[4].tolist())) == 3  # three different labels, three different logprobs


def test_prompt_alt_tokens_greedy_are_the_top_token(sampler: Any) -> None:
    k = 3
    res = sampler.sample(prompt(), 1, types.SamplingParams(max_tokens=1, temperature=0.0),
                         prompt_alt_tokens_k=k).result()
    tokens, logprobs = res.prompt_alt_tokens.tokens.to_torch(), res.prompt_alt_tokens.logprobs.to_torch()
    assert tokens.shape == logprobs.shape == (len(PROMPT) - 1, k)
    best = scored(sampler, PROMPT, 1).topk_prompt_logprobs[1:]
    assert tokens.tolist() == [[row[0][0]] * k for row in best]
    assert logprobs[:, 0].tolist() == pytest.approx([row[0][1] for row in best], abs=1e-4)
    drawn = sampler.sample(prompt(), 1, types.SamplingParams(max_tokens=1, temperature=1.0, seed=5),
                           prompt_alt_tokens_k=k).result()
    again = sampler.sample(prompt(), 1, types.SamplingParams(max_tokens=1, temperature=1.0, seed=5),
                           prompt_alt_tokens_k=k).result()
    assert drawn.prompt_alt_tokens.tokens.to_torch().tolist() == again.prompt_alt_tokens.tokens.to_torch().tolist()


@pytest.mark.parametrize("kwargs,field", [
    ({"topk_sample_logprobs": 21}, "topk_sample_logprobs"),
    ({"prompt_alt_tokens_k": 21}, "prompt_alt_tokens_k"),
    ({"include_prompt_logprobs": True, "prompt_logprobs_last_n": len(PROMPT)}, "prompt_logprobs_last_n"),
    ({"target_prompt_logprobs": types.TensorData(data=[1] * len(PROMPT), dtype="int64", shape=[len(PROMPT), 1])},
     "target_prompt_logprobs"),
])
def test_bad_values_are_a_400_naming_the_field(sampler: Any, kwargs: dict[str, Any], field: str) -> None:
    import tinker

    with pytest.raises(tinker.BadRequestError, match=field):
        sampler.sample(prompt(), 1, types.SamplingParams(max_tokens=1), **kwargs).result()


def test_a_growing_conversation_is_served_from_the_prefix_cache(sampler: Any) -> None:
    """Multi-turn RL re-sends a growing prompt: the second turn's prefix (prompt + first answer) is not prefilled again
    (SampleResponse.prompt_cache_hit_tokens), and its results equal a fresh prefill's (prompt logprobs of the tail)."""
    turn = [9, 8, 7, 6, 5, 4, 3, 2, 1]
    first = sampler.sample(prompt(turn), 1, types.SamplingParams(max_tokens=4, temperature=0.0)).result()
    assert first.prompt_cache_hit_tokens == 0
    history = turn + list(first.sequences[0].tokens) + [40, 41]
    second = sampler.sample(prompt(history), 1, types.SamplingParams(max_tokens=4, temperature=0.0),
                            include_prompt_logprobs=True, prompt_logprobs_last_n=2).result()
    assert second.prompt_cache_hit_tokens == len(turn) + len(first.sequences[0].tokens) - 1
    whole = sampler.compute_logprobs(prompt(history)).result()  # scores every position: nothing from the cache
    assert second.prompt_logprobs[-2:] == pytest.approx(whole[-2:], abs=1e-5)
