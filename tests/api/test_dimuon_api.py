"""Dimuon through the real tinker SDK on a live server: create with DimuonOptimizerConfig, train (the loss falls),
get_info / weights_info report it, its momentum resumes exactly from save_state, and the other family's params,
bad values and full fine-tuning are user errors naming the field."""

from __future__ import annotations

from typing import Any

import pytest
import sdk_training
import tinker
from tinker import types

BASE_MODEL, RANK = "tiny-qwen3", 4
DIMUON = types.DimuonParams(learning_rate=0.02, grad_clip_norm=1.0, beta1=0.9)


def family(config: Any) -> dict:
    """The SDK parses a non-Adam optimizer_config as its generic OptimizerConfigBase: compare the fields."""
    return config.model_dump()


DIMUON_CONFIG, ADAM_CONFIG = {"type": "dimuon", "version": 1}, {"type": "adamw"}


def dimuon_client(service_client: Any, seed: int) -> tinker.TrainingClient:
    return service_client.create_lora_training_client(base_model=BASE_MODEL, rank=RANK, seed=seed,
                                                      optimizer=types.DimuonOptimizerConfig()).result()


def test_dimuon_trains_and_the_loss_falls(service_client: Any) -> None:
    client = dimuon_client(service_client, seed=3)
    assert family(client.get_info().optimizer_config) == DIMUON_CONFIG
    losses = [sdk_training.train_step(client, 0, DIMUON) for _ in range(6)]  # the same batch every step
    assert losses[-1] < 0.9 * losses[0], losses
    metrics = client.optim_step(DIMUON).result().metrics  # no gradients pending: a zero-gradient step
    assert metrics["step"] == 7


def unload(http: Any, *clients: tinker.TrainingClient) -> None:
    """Frees the models' adapter slots (the module's server has a few)."""
    for client in clients:
        assert http.post("/api/v1/unload_model", json={"model_id": client.model_id}).status_code == 200


def test_save_state_resumes_dimuon_exactly(service_client: Any, tinker_env: str, http: Any) -> None:
    client = dimuon_client(service_client, seed=5)
    for step in range(2):
        sdk_training.train_step(client, step, DIMUON)
    path = client.save_state("dimuon_point").result().path
    expected = [sdk_training.train_step(client, 10 + k, DIMUON) for k in range(2)]

    rest = tinker.RestClient(base_url=tinker_env)
    assert family(rest.get_weights_info_by_tinker_path(path).result().optimizer_config) == DIMUON_CONFIG
    resumed = service_client.create_training_client_from_state_with_optimizer(path).result()
    assert family(resumed.get_info().optimizer_config) == DIMUON_CONFIG
    assert [sdk_training.train_step(resumed, 10 + k, DIMUON) for k in range(2)] == pytest.approx(expected, rel=1e-5)

    weights_only = service_client.create_training_client_from_state(path).result()  # the SDK's default: Adam
    assert family(weights_only.get_info().optimizer_config) == ADAM_CONFIG
    with pytest.raises(tinker.BadRequestError, match="adam_params"):
        weights_only.optim_step(DIMUON).result()
    chosen = service_client.create_training_client_from_state(path, optimizer=types.DimuonOptimizerConfig()).result()
    assert family(chosen.get_info().optimizer_config) == DIMUON_CONFIG
    without = [sdk_training.train_step(chosen, 10 + k, DIMUON) for k in range(2)]
    assert without[0] == pytest.approx(expected[0], rel=1e-5)  # same weights
    assert abs(without[-1] - expected[-1]) > 1e-4  # fresh momentum: the trajectory differs
    fresh_adam = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=RANK, seed=5).result()
    with pytest.raises(tinker.BadRequestError, match="holds dimuon optimizer state.*uses adamw"):
        fresh_adam.load_state_with_optimizer(path).result()
    fresh_adam.load_state(path).result()  # the weights alone are fine
    unload(http, client, resumed, weights_only, chosen, fresh_adam)


def test_params_of_the_other_family_are_refused(service_client: Any, http: Any) -> None:
    dimuon = dimuon_client(service_client, seed=7)
    with pytest.raises(tinker.BadRequestError, match="uses the dimuon optimizer.*optimizer_params"):
        dimuon.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    adam = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=RANK, seed=7).result()
    assert family(adam.get_info().optimizer_config) == ADAM_CONFIG
    with pytest.raises(tinker.BadRequestError, match="uses the adamw optimizer.*adam_params"):
        adam.optim_step(DIMUON).result()
    with pytest.raises(tinker.BadRequestError, match="full fine-tuning"):
        service_client.create_lora_training_client(base_model=BASE_MODEL, rank=0,
                                                   optimizer=types.DimuonOptimizerConfig()).result()
    unload(http, dimuon, adam)


@pytest.fixture(scope="module")
def raw_target(service_client: Any) -> tinker.TrainingClient:
    return dimuon_client(service_client, seed=9)


@pytest.mark.parametrize(("seq_id", "params", "field"), [
    (1, {"learning_rate": 0.01, "beta1": 1.0}, "beta1"),
    (2, {"learning_rate": -1.0}, "learning_rate"),
    (3, {"learning_rate": "fast"}, "learning_rate"),
    (4, {"learning_rate": 0.01, "damping": 0.1}, "damping"),
    (5, {"beta1": 0.9}, "learning_rate"),
])
def test_bad_dimuon_params_name_the_field(raw_target: tinker.TrainingClient, http: Any, seq_id: int, params: dict,
                                          field: str) -> None:
    """Values the SDK's own checks would stop, sent raw: a 400 naming the field."""
    response = http.post("/api/v1/optim_step", json={"model_id": raw_target.model_id, "seq_id": seq_id,
                                                     "optimizer_params": {"type": "dimuon", **params}})
    assert response.status_code == 400, response.text
    assert "optimizer_params" in response.text and field in response.text, response.text


def test_capabilities_list_the_optimizers(http: Any, tinker_env: str) -> None:
    capabilities = http.get("/api/v1/get_server_capabilities").json()
    assert capabilities["supported_optimizers"] == [ADAM_CONFIG, DIMUON_CONFIG]
    assert tinker.RestClient(base_url=tinker_env).get_server_capabilities().result().supported_models  # SDK parses it


def test_bad_optimizer_config_is_refused(http: Any, service_client: Any) -> None:
    session = service_client.holder.get_session_id()
    for config, field in (({"type": "dimuon", "version": 2}, "version"), ({"type": "sgd"}, "type"),
                          ({"type": "dimuon", "damping": 1}, "damping")):
        response = http.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 900,
                                                           "base_model": BASE_MODEL, "lora_config": {"rank": RANK},
                                                           "optimizer_config": config})
        assert response.status_code == 400 and "optimizer_config" in response.text and field in response.text, \
            response.text
