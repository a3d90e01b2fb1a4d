"""Checkpoints of full fine-tuning (LoRA rank 0) through the real SDK: exact resume, HF sampler exports, sampling.

The SDK 0.38 has no separate full fine-tuning call: `create_lora_training_client(rank=0)` sends
LoraConfig(rank=0) as is, which the server takes as full fine-tuning (every HF parameter trainable).
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tinker
import torch
import sdk_training
from hf_reference import hf_token_logprobs, load_hf_model
from sdk_training import TOKENS, server_logprobs
from tinker import types

ADAM = types.AdamParams(learning_rate=1e-3)
RESUME_STEPS = 3
GREEDY = types.SamplingParams(max_tokens=8, temperature=0.0)
PROMPT = types.ModelInput.from_ints(TOKENS[:6])


@pytest.fixture(scope="module")
def server_options() -> dict[str, Any]:
    # Full models alive at once per server: `trained` + the resume test's original, resumed and weights-only.
    return {"backend_config": {"max_full_models": 4}}


def train_step(client: tinker.TrainingClient, step: int) -> float:
    return sdk_training.train_step(client, step, ADAM)


def signed_urls(tinker_path: str, base_url: str) -> dict[str, str]:
    """external_weights through the SDK's RestClient; the SDK refuses any other kind client-side, so a sampler
    checkpoint's URLs come from the same server route called directly (this server signs every kind)."""
    if "/external_weights/" in tinker_path:
        return tinker.RestClient(base_url=base_url).get_external_weights_urls(tinker_path).result().urls
    run_id, checkpoint_id = tinker_path.removeprefix("tinker://").split("/", 1)
    url = f"{base_url}/api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id}/external_weights_urls"
    with urllib.request.urlopen(url) as response:
        return json.loads(response.read())["urls"]


def download(tinker_path: str, base_url: str, dest: Path) -> Path:
    return sdk_training.download(signed_urls(tinker_path, base_url), dest)


def greedy(sampler: tinker.SamplingClient) -> tuple[list[int], list[float]]:
    seq = sampler.sample(PROMPT, 1, GREEDY).result().sequences[0]
    return list(seq.tokens), list(seq.logprobs or [])


def create_full(service_client: tinker.ServiceClient, seed: int) -> tinker.TrainingClient:
    return service_client.create_lora_training_client(base_model="tiny-qwen3", rank=0, seed=seed).result()


@pytest.fixture(scope="module")
def trained(service_client) -> tinker.TrainingClient:
    client = create_full(service_client, seed=3)
    for step in range(2):
        train_step(client, step)
    return client


def test_full_model_is_reported_as_not_lora(service_client, trained, tinker_env) -> None:
    info = trained.get_info()
    assert (info.is_lora, info.lora_rank, info.model_data.model_name) == (False, None, "tiny-qwen3"), info
    path = trained.save_state("info").result().path
    # base_url explicit: RestClient() caches its connection per process under base_url=None, so it would keep
    # talking to the previous module server (the SQLite one) after TINKER_BASE_URL changed.
    weights = tinker.RestClient(base_url=tinker_env).get_weights_info_by_tinker_path(path).result()
    assert (weights.base_model, weights.is_lora, weights.lora_rank) == ("tiny-qwen3", False, None)


def test_resume_with_optimizer_is_exact_and_without_differs(service_client) -> None:
    client = create_full(service_client, seed=5)
    for step in range(2):
        train_step(client, step)
    path = client.save_state("resume_point").result().path
    assert path == f"tinker://{client.model_id}/weights/resume_point"
    expected = [train_step(client, 10 + k) for k in range(RESUME_STEPS)]
    assert expected[-1] < expected[0]  # the full model learns

    resumed = service_client.create_training_client_from_state_with_optimizer(path).result()
    assert resumed.model_id != client.model_id
    assert [train_step(resumed, 10 + k) for k in range(RESUME_STEPS)] == pytest.approx(expected, rel=1e-5, abs=1e-5)

    weights_only = service_client.create_training_client_from_state(path).result()
    without = [train_step(weights_only, 10 + k) for k in range(RESUME_STEPS)]
    assert without[0] == pytest.approx(expected[0], rel=1e-5)  # same weights: the first loss agrees
    assert abs(without[-1] - expected[-1]) > 1e-3  # fresh AdamW moments: the trajectory differs


@pytest.mark.parametrize("save", ["sampler", "external"])
def test_sampler_and_external_exports_are_hf_model_directories(service_client, trained, tinker_env, tiny_model_dir,
                                                               tmp_path, save) -> None:
    name = f"hf_{save}"
    path = (trained.save_weights_for_sampler(name) if save == "sampler" else trained.save_weights_external(name)
            ).result().path
    model_dir = download(path, tinker_env, tmp_path / "model")
    files = {p.name for p in model_dir.iterdir()}
    assert {"config.json", "model.safetensors"} <= files and "adapter_config.json" not in files, files
    assert json.loads((model_dir / "config.json").read_text()) == json.loads(
        (tiny_model_dir("tiny-qwen3") / "config.json").read_text())

    tokens = TOKENS[:20]
    expected = server_logprobs(trained, tokens)
    base = hf_token_logprobs(load_hf_model(tiny_model_dir("tiny-qwen3")), tokens)
    assert (expected - base).abs().max() > 1e-3  # the export is the trained model, not the base
    torch.testing.assert_close(hf_token_logprobs(load_hf_model(model_dir), tokens), expected, atol=1e-4, rtol=0)


def test_sampler_checkpoint_samples_like_the_live_snapshot_and_is_frozen(service_client, trained) -> None:
    path = trained.save_weights_for_sampler("frozen_point").result().path
    assert path == f"tinker://{trained.model_id}/sampler_weights/frozen_point"
    live = trained.save_weights_and_get_sampling_client().result()  # ephemeral snapshot at the same point
    saved = service_client.create_sampling_client(model_path=path).result()
    live_tokens, live_logprobs = greedy(live)
    saved_tokens, saved_logprobs = greedy(saved)
    assert len(saved_tokens) == GREEDY.max_tokens
    assert saved_tokens == live_tokens
    np.testing.assert_allclose(saved_logprobs, live_logprobs, atol=1e-4)

    for step in range(5):  # train the live model on; neither snapshot may follow it
        train_step(trained, 20 + step)
    after_tokens, after_logprobs = greedy(trained.save_weights_and_get_sampling_client().result())
    moved = after_tokens != saved_tokens or np.abs(np.subtract(after_logprobs, saved_logprobs)).max() > 1e-3
    assert moved, "training did not change the live model's samples; the frozen check would be vacuous"

    # The same tokens, and logprobs within 1e-5 rather than bit for bit: sampled again, the prompt hits the prefix
    # cache and its last token is recomputed alone (attention over one query row instead of the prefill's causal
    # block), which may round a logprob differently by an ulp. With ATen's formulas throughout, prompts of 5 and 7
    # tokens showed it (one logprob ~4.8e-7 off) and this 6-token one happened not to. Training moves them by >1e-3.
    fresh = service_client.create_sampling_client(model_path=path).result()
    for sampler, tokens, logprobs in ((saved, saved_tokens, saved_logprobs), (live, live_tokens, live_logprobs),
                                      (fresh, saved_tokens, saved_logprobs)):
        again_tokens, again_logprobs = greedy(sampler)
        assert again_tokens == tokens
        np.testing.assert_allclose(again_logprobs, logprobs, rtol=0, atol=1e-5)
