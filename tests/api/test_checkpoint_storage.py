"""Checkpoint storage end to end: an S3 store, a server restart on the same data, and a store that fails."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tinker
from live_server import live_server
from s3_server import make_bucket, moto_s3, s3_options
from tinker import types

TOKENS = list(range(5, 29))
GREEDY = types.SamplingParams(max_tokens=5, temperature=0.0)
PROMPT = types.ModelInput.from_ints(TOKENS[:6])


@pytest.fixture()
def sdk_env(monkeypatch) -> Iterator[None]:
    monkeypatch.setenv("TINKER_API_KEY", "tml-test")
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    yield


def train(client: tinker.TrainingClient, steps: int = 2) -> list[float]:
    datum = types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]),
                        loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)})
    losses = []
    for _ in range(steps):
        out = client.forward_backward([datum], "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        losses.append(float(-np.asarray(out.loss_fn_outputs[0]["logprobs"].tolist()).sum()))
    return losses


def greedy(client: tinker.ServiceClient, path: str) -> list[int]:
    return client.create_sampling_client(model_path=path).result().sample(PROMPT, 1, GREEDY).result().sequences[0].tokens


def test_s3_store_round_trip(sdk_env, monkeypatch, preset_cache) -> None:
    with moto_s3() as endpoint:
        make_bucket(endpoint, "skyrl-ckpt")
        args = ["--checkpoints-base", "s3://skyrl-ckpt/runs", "--checkpoints-storage-options",
                json.dumps(s3_options(endpoint))]
        with live_server(extra_args=args) as url:
            monkeypatch.setenv("TINKER_BASE_URL", url)
            with tinker.ServiceClient() as service:
                client = service.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=1).result()
                train(client)
                state = client.save_state("s3_state").result().path
                sampler = client.save_weights_for_sampler("s3_sampler").result().path
                expected = train(client)
                resumed = service.create_training_client_from_state_with_optimizer(state).result()
                assert train(resumed) == pytest.approx(expected, rel=1e-5)
                tokens = greedy(service, sampler)
                assert len(tokens) == 5
        import s3fs

        keys = s3fs.S3FileSystem(**s3_options(endpoint)).find("skyrl-ckpt/runs")
        assert any(k.endswith("weights/s3_state/optimizer.safetensors") for k in keys), keys
        assert any(k.endswith("sampler_weights/s3_sampler/adapter_model.safetensors") for k in keys), keys


def test_restart_keeps_checkpoints_loadable_and_sampleable(sdk_env, monkeypatch, preset_cache) -> None:
    data_dir = Path(tempfile.mkdtemp(prefix="skyrl_tx_restart_"))
    try:
        with live_server(data_dir=data_dir) as url:
            monkeypatch.setenv("TINKER_BASE_URL", url)
            with tinker.ServiceClient() as service:
                client = service.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=2).result()
                train(client)
                state = client.save_state("before_restart").result().path
                sampler = client.save_weights_for_sampler("before_restart").result().path
                expected_tokens = greedy(service, sampler)
                expected_losses = train(client)
        with live_server(data_dir=data_dir) as url:  # a new process: nothing of the first is in memory
            monkeypatch.setenv("TINKER_BASE_URL", url)
            with tinker.ServiceClient() as service:
                assert greedy(service, sampler) == expected_tokens
                resumed = service.create_training_client_from_state_with_optimizer(state).result()
                assert train(resumed) == pytest.approx(expected_losses, rel=1e-5)
                listed = {c.tinker_path for c in tinker.RestClient(base_url=url).list_user_checkpoints().result().checkpoints}
                assert {state, sampler} <= listed
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)


def test_failing_store_is_a_clear_error_and_training_goes_on(sdk_env, monkeypatch, preset_cache) -> None:
    data_dir = Path(tempfile.mkdtemp(prefix="skyrl_tx_broken_store_"))
    store = data_dir / "checkpoints"
    try:
        with live_server(data_dir=data_dir) as url:
            monkeypatch.setenv("TINKER_BASE_URL", url)
            with tinker.ServiceClient() as service:
                client = service.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=3).result()
                train(client, 1)
                shutil.rmtree(store)
                store.write_text("a file where the checkpoint directory should be")  # every write now fails
                with pytest.raises(tinker.RequestFailedError, match="checkpoint store"):
                    client.save_state("doomed").result()
                rest = tinker.RestClient(base_url=url)
                assert rest.list_checkpoints(client.model_id).result().checkpoints == []
                after_failure = train(client, 1)  # the model is untouched and keeps training
                assert np.isfinite(after_failure).all()
                store.unlink()
                store.mkdir()
                path = client.save_state("doomed").result().path  # the same name works once the store does
                assert [c.tinker_path for c in rest.list_checkpoints(client.model_id).result().checkpoints] == [path]
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
