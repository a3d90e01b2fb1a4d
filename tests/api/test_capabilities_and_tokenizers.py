"""get_server_capabilities and the SDK's get_tokenizer() through the real SDK against a live server: every name of
the base model (aliases, and its directory) is listed trainable and sampleable with the context every request gets;
TrainingClient.get_tokenizer() loads from the directory get_info reports; SamplingClient.get_tokenizer() loads by
the base model's name, which works offline when that name is the model directory (presets and local directories).
Without API keys, whoami (`tinker auth login`'s check) names the one local owner, who lists every session."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
from live_server import live_server
from sdk_training import datum
from tinker import types
from transformers import AutoTokenizer

BASE_MODEL = "tiny-qwen3"
ALIAS = "Qwen/Qwen3-8B"
MAX_SAMPLING_LENGTH = 96
TEXT = "English: banana split\nPig Latin:"


@pytest.fixture(scope="module")
def server_options() -> dict[str, Any]:
    return {"aliases": [ALIAS], "backend_config": {"max_sampling_length": MAX_SAMPLING_LENGTH}}


@pytest.fixture(scope="module")
def preset_dir(tiny_model_dir: Any) -> Path:
    return tiny_model_dir(BASE_MODEL)


def encodes_like(tokenizer: Any, directory: Path) -> bool:
    return tokenizer.encode(TEXT) == AutoTokenizer.from_pretrained(str(directory)).encode(TEXT)


def capabilities(base_url: str) -> list[types.SupportedModel]:
    return tinker.RestClient(base_url=base_url).get_server_capabilities().result().supported_models


def test_capabilities_list_every_name_trainable_and_sampleable(tinker_env: str, preset_dir: Path) -> None:
    models = capabilities(tinker_env)
    assert [m.model_name for m in models] == [BASE_MODEL, ALIAS, str(preset_dir)]
    positions = json.loads((preset_dir / "config.json").read_text())["max_position_embeddings"]
    assert positions > MAX_SAMPLING_LENGTH  # so the sampling limit is the one reported
    for model in models:
        assert (model.trainable, model.sampleable, model.max_context_length) == (True, True, MAX_SAMPLING_LENGTH)


def test_training_client_tokenizer_comes_from_the_model_directory(service_client: Any, preset_dir: Path) -> None:
    training_client = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=1).result()
    assert training_client.get_info().model_data.tokenizer_id == str(preset_dir)
    assert encodes_like(training_client.get_tokenizer(), preset_dir)


def test_sampling_client_named_by_the_model_directory_loads_its_tokenizer(service_client: Any,
                                                                          preset_dir: Path) -> None:
    sampler = service_client.create_sampling_client(base_model=str(preset_dir)).result()
    tokenizer = sampler.get_tokenizer()
    assert encodes_like(tokenizer, preset_dir)
    result = sampler.sample(types.ModelInput.from_ints(tokenizer.encode(TEXT)), 1,
                            types.SamplingParams(max_tokens=4, temperature=0.0)).result()
    assert len(result.sequences[0].tokens) == 4


def test_sampler_from_weights_of_a_directory_named_model_loads_its_tokenizer(service_client: Any,
                                                                              preset_dir: Path) -> None:
    """A training client named by the directory: its saved sampler weights report that name as their base model,
    so a new sampling client (created from the path alone) finds the tokenizer too."""
    training_client = service_client.create_lora_training_client(base_model=str(preset_dir), rank=4, seed=2).result()
    training_client.forward_backward([datum(0)], "cross_entropy").result()
    training_client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    path = training_client.save_weights_for_sampler("tok").result().path
    sampler = service_client.create_sampling_client(model_path=path).result()
    assert sampler.get_base_model() == str(preset_dir)
    assert encodes_like(sampler.get_tokenizer(), preset_dir)


def test_sampling_client_of_a_local_model_directory_loads_its_tokenizer(preset_dir: Path, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A server started on a local directory: the name clients use is the path, listed once. Its own server (SQLite),
    not the module's: it runs once, not once per database backend of the module's server."""
    monkeypatch.setenv("TINKER_API_KEY", "tml-test")
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    local = tmp_path / "models" / "my-tiny"
    shutil.copytree(preset_dir, local)
    with live_server(base_model=str(local)) as url:
        with tinker.ServiceClient(base_url=url) as service_client:
            assert [m.model_name for m in capabilities(url)] == [str(local)]
            sampler = service_client.create_sampling_client(base_model=str(local)).result()
            assert encodes_like(sampler.get_tokenizer(), local)


def test_without_keys_whoami_is_the_local_owner_of_every_session(tinker_env: str, service_client: Any) -> None:
    from tinker.cli.auth_api import TinkerAuthApi

    with httpx.Client(timeout=60) as http:
        me = TinkerAuthApi(http, base_url=tinker_env).get_self_api_key("tml-anything")
        assert me.name == "local" and me.key_id == 0 and "--auth none" in me.note
        logout = http.delete(f"{tinker_env}/api/v1/auth/apikey/me", headers={"X-API-Key": "tml-anything"})
        assert logout.status_code == 400 and "no key to delete" in logout.json()["message"]
    rest = tinker.RestClient(base_url=tinker_env)  # named: the SDK reuses a RestClient holder across servers
    session_id = service_client.holder.get_session_id()
    assert session_id in rest.list_sessions(limit=1000).result().sessions
    got = rest.get_session(session_id).result()
    assert all(run.startswith(f"{session_id}:") for run in got.training_run_ids + got.sampler_ids)
