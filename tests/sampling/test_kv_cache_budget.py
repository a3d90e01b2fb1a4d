"""The KV cache sized by a budget (kv_cache_tokens on any device; gpu_memory_utilization on a GPU, tests/gpu): the
rows it gives, sampling that queues beyond them and still equals an unbounded cache's tokens, and the refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from sampling_reference import greedy_requests, random_prompts, run_continuous

from skyrl_tx._ext import load_extension
from skyrl_tx.backend.native import NativeBackend
from skyrl_tx.config import BackendSettings
from skyrl_tx.errors import InvalidArgumentError
from skyrl_tx.types import SampleRequest, SamplingParams

LENGTH = 64


@pytest.fixture(scope="module")
def path(tiny_model_dir) -> Path:
    return tiny_model_dir("tiny-qwen3")


def test_kv_cache_tokens_sets_the_rows_and_sampling_queues_beyond_them(path: Path) -> None:
    budget = BackendSettings.from_dict({"kv_cache_tokens": 3 * LENGTH + LENGTH // 2, "max_sampling_length": LENGTH})
    assert budget.max_sampling_sequences == 3  # whole rows of max_sampling_length tokens
    roomy = BackendSettings.from_dict({"max_sampling_sequences": 16, "max_sampling_length": LENGTH})
    small, large = NativeBackend(path, budget), NativeBackend(path, roomy)
    eos = set(small.eos_token_ids)
    requests = greedy_requests(random_prompts(small.decoder_config.vocab_size, [5, 9, 3, 7, 4, 6], seed=3, avoid=eos),
                               max_tokens=12)
    queued, queued_at = run_continuous(small, requests)
    together, together_at = run_continuous(large, requests)
    for i in range(len(requests)):
        assert queued[i].sequences[0].tokens == together[i].sequences[0].tokens, i
        torch.testing.assert_close(torch.tensor(queued[i].sequences[0].logprobs),
                                   torch.tensor(together[i].sequences[0].logprobs), rtol=0, atol=1e-6)
    # 6 requests through 3 rows take longer than through 16: the last 3 waited for rows
    assert max(queued_at.values()) > max(together_at.values()), (queued_at, together_at)
    with pytest.raises(InvalidArgumentError, match="kv_cache_tokens"):
        small.sample([SampleRequest([1, 2, 3], SamplingParams(max_tokens=2), num_samples=4)])


@pytest.mark.parametrize(("raw", "fragment"), [
    ({"kv_cache_tokens": 4096, "max_sampling_sequences": 8}, "max_sampling_sequences and kv_cache_tokens each size"),
    ({"kv_cache_tokens": 100, "max_sampling_length": 128}, "less than one sequence of max_sampling_length=128"),
    ({"kv_cache_tokens": -1}, "kv_cache_tokens must be >= 0"),
    ({"gpu_memory_utilization": 0.5}, "on a CPU give kv_cache_tokens"),
    ({"device": "cuda", "gpu_memory_utilization": 1.5}, r"gpu_memory_utilization must be in \(0, 1\]"),
    ({"device": "cuda", "gpu_memory_utilization": 0.5, "kv_cache_tokens": 4096}, "each size the KV cache; give one"),
])
def test_kv_cache_budgets_that_cannot_work_are_refused_by_name(raw: dict, fragment: str) -> None:
    with pytest.raises(InvalidArgumentError, match=fragment):
        BackendSettings.from_dict(raw)


def test_the_seed_key_is_gpu_memory_utilization() -> None:
    settings = BackendSettings.from_dict({"device": "cuda:1", "generator.inference_engine.gpu_memory_utilization": 1})
    assert settings.gpu_memory_utilization == 1.0  # JSON's 1 for 1.0 is a float setting's value too


def test_the_core_refuses_a_memory_fraction_on_a_cpu_even_past_the_settings(path: Path) -> None:
    """The C++ Backend checks it too (a caller of the extension skips BackendSettings)."""
    from skyrl_tx.backend.native import _native_backend_config, _native_model_config
    from skyrl_tx.models.checkpoint import load_weights
    from skyrl_tx.models.hf_config import load_decoder_config

    native = _native_backend_config(BackendSettings())
    native.gpu_memory_utilization = 0.5
    with pytest.raises(InvalidArgumentError, match="gpu_memory_utilization sizes the KV cache from a CUDA device"):
        load_extension().Backend(_native_model_config(load_decoder_config(path)), native, load_weights(path))


def test_a_budget_survives_the_round_trip_to_ranks_and_engines() -> None:
    """Ranks and sampler engines get the settings as a dict (dataclasses.asdict): the derived rows are no conflict."""
    import dataclasses

    budget = BackendSettings.from_dict({"kv_cache_tokens": 4 * LENGTH, "max_sampling_length": LENGTH})
    assert BackendSettings.from_dict(dataclasses.asdict(budget)) == budget
