"""API keys on a live --auth keys server: a missing, unknown or revoked key gets 401 (X-API-Key and Bearer both
work, healthz stays open); a revoked key's models unload after the session timeout; max_inflight_requests answers
429 with Retry-After, max_live_models a 403 the SDK raises at once; --auth none is refused off loopback, with the command that makes a key."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tinker
from keyed_server import keyed_server, status_of
from live_server import REPO, ServerUrl
from sdk_training import datum
from sqlalchemy import create_engine, select

from skyrl_tx.config import ServerSettings
from skyrl_tx.db.models import ModelRecord
from skyrl_tx.errors import InvalidArgumentError
from skyrl_tx.keys import revoke_key

SESSION_TIMEOUT_S = 15  # the SDK heartbeats every 10 s
KEYS = {"user": {}, "leaver": {}, "one_model": {"max_live_models": 1}, "one_model_sdk": {"max_live_models": 1},
        "one_request": {"max_inflight_requests": 1}}


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def server_url(request: pytest.FixtureRequest, preset_cache) -> Iterator[ServerUrl]:
    with keyed_server(request.param, KEYS, extra_args=["--session-timeout", str(SESSION_TIMEOUT_S)]) as url:
        yield url


def http(server_url: ServerUrl, key: str | None = None, bearer: bool = False) -> httpx.Client:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"} if bearer else {"X-API-Key": key}
    return httpx.Client(base_url=server_url, headers=headers, timeout=60)


def test_requests_without_a_valid_key_get_401_and_healthz_stays_open(server_url) -> None:
    for client, fragment in [(http(server_url), "missing API key"),
                             (http(server_url, "tml-not-a-key"), "unknown API key"),
                             (http(server_url, "tml-not-a-key", bearer=True), "unknown API key")]:
        with client:
            response = client.post("/api/v1/create_session", json={})
            assert response.status_code == 401, response.text
            assert fragment in response.json()["message"] and "skyrl-tx keys create" in response.json()["message"]
            assert client.get("/api/v1/training_runs").status_code == 401
            assert client.get("/api/v1/healthz").status_code == 200
    for bearer in (False, True):
        with http(server_url, server_url.keys["user"], bearer=bearer) as client:
            assert client.post("/api/v1/create_session", json={}).status_code == 200


def test_the_sdk_with_an_unknown_key_gets_401(server_url, monkeypatch) -> None:
    monkeypatch.setenv("TINKER_TELEMETRY", "0")

    def connect() -> None:
        with tinker.ServiceClient(base_url=server_url, api_key="tml-unknown") as client:
            client.create_lora_training_client(base_model="tiny-qwen3", rank=4).result()

    assert status_of(connect) == 401


def _model_status(server_url: ServerUrl, model_id: str) -> str:
    engine = create_engine(server_url.database_url)
    try:
        with engine.connect() as db:
            return db.execute(select(ModelRecord.status).where(ModelRecord.id == model_id)).scalar_one()
    finally:
        engine.dispose()


def test_a_revoked_key_fails_its_next_call_with_401_and_its_models_unload(server_url, monkeypatch) -> None:
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    client = tinker.ServiceClient(base_url=server_url, api_key=server_url.keys["leaver"])
    try:
        training = client.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=1).result()
        training.forward_backward([datum(0)], "cross_entropy").result()
        saved = training.save_weights_external("leaver-ckpt").result().path
        url = next(iter(client.create_rest_client().get_external_weights_urls(saved).result().urls.values()))
        assert httpx.get(url, timeout=60).status_code == 200
        revoke_key(server_url.database_url, "leaver")  # what `skyrl-tx keys revoke leaver` does
        time.sleep(1.5)  # the server re-reads a key at least once a second
        assert status_of(lambda: training.forward_backward([datum(1)], "cross_entropy").result()) == 401
        with http(server_url, server_url.keys["leaver"]) as raw:
            response = raw.post("/api/v1/get_info", json={"model_id": training.model_id})
            assert response.status_code == 401 and "was revoked" in response.json()["message"]
        # The download URLs it was given stop working too, before they expire.
        download = httpx.get(url, timeout=60)
        assert download.status_code == 404 and "was revoked" in download.json()["message"], download.text
        # Its heartbeats are refused too: the session times out and the engine unloads its model.
        deadline = time.monotonic() + SESSION_TIMEOUT_S + 45
        while _model_status(server_url, training.model_id) != "unloaded":
            assert time.monotonic() < deadline, "the revoked key's model was not unloaded after the session timeout"
            time.sleep(1)
    finally:
        with contextlib.suppress(tinker.AuthenticationError):  # finishing the session is refused too
            client.close("success").result()


def _session(client: httpx.Client) -> str:
    return client.post("/api/v1/create_session", json={}).json()["session_id"]


def _create_model(client: httpx.Client, session: str, seq: int) -> httpx.Response:
    return client.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": seq,
                                                     "base_model": "tiny-qwen3", "lora_config": {"rank": 4}})


def test_max_live_models_answers_403_without_retry_after(server_url) -> None:
    with http(server_url, server_url.keys["one_model"]) as client:
        session = _session(client)
        assert _create_model(client, session, 0).status_code == 200
        assert _create_model(client, session, 0).status_code == 200  # a retry of the same model is no new one
        refused = _create_model(client, session, 1)
        # Not 429: waiting frees no slot, and the SDK retries a 429 for hours.
        assert refused.status_code == 403, refused.text
        assert "Retry-After" not in refused.headers
        assert refused.json()["type"] == "quota_exceeded"
        assert "max_live_models quota is 1" in refused.json()["message"]
        assert "unload_model" in refused.json()["message"]
        # An unloaded model frees its place.
        assert client.post("/api/v1/unload_model", json={"model_id": f"{session}:train:0"}).status_code == 200
        deadline = time.monotonic() + 60
        while (response := _create_model(client, session, 1)).status_code == 403:
            assert time.monotonic() < deadline, response.text
            time.sleep(0.5)
        assert response.status_code == 200


def test_the_sdk_raises_the_live_model_quota_instead_of_retrying(server_url, monkeypatch) -> None:
    """create_lora_training_client beyond max_live_models raises PermissionDeniedError with the server's message; as a
    429 the SDK kept retrying it (for up to two hours), so the call seemed to hang. Bounded by a 60 s join."""
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    with tinker.ServiceClient(base_url=server_url, api_key=server_url.keys["one_model_sdk"]) as client:
        client.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=1).result()
        outcome: list[BaseException] = []

        def second() -> None:
            try:
                client.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=2).result()
            except BaseException as exc:  # noqa: BLE001 - checked below, in the test's thread
                outcome.append(exc)

        thread = threading.Thread(target=second, daemon=True)
        thread.start()
        thread.join(60)
        assert not thread.is_alive(), "the SDK still retries create_lora_training_client beyond max_live_models"
        assert outcome, "a second model was created beyond max_live_models 1"

        def raise_it() -> None:
            raise outcome[0]

        assert status_of(raise_it) == 403
        assert "max_live_models quota is 1" in str(outcome[0]), repr(outcome[0])


def test_max_inflight_requests_answers_429_with_retry_after(server_url) -> None:
    with http(server_url, server_url.keys["one_request"]) as client:
        session = _session(client)
        model_id = _create_model(client, session, 0).json()["model_id"]
        created = client.post("/api/v1/retrieve_future", json={"request_id": f"{model_id}:create"})
        assert created.status_code == 200 and "model_id" in created.json(), created.text

        def optim_step(seq_id: int) -> httpx.Response:
            return client.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": seq_id,
                                                           "adam_params": {"learning_rate": 1e-3}})

        # seq_id 3 waits for 1 and 2, which never come: one request stays queued.
        assert optim_step(3).status_code == 200
        refused = optim_step(4)
        assert refused.status_code == 429, refused.text
        assert int(refused.headers["Retry-After"]) > 0
        assert "max_inflight_requests quota is 1" in refused.json()["message"]
        # The refusal stored nothing: seq_id 4 is not consumed (the SDK retries a 429 with the same seq_id).
        assert client.post("/api/v1/retrieve_future", json={"request_id": f"{model_id}:4"}).status_code == 404


def test_auth_none_off_loopback_refuses_to_start_with_the_command_that_makes_a_key(tmp_path: Path) -> None:
    for host in ("0.0.0.0", "10.1.2.3", "example.com"):
        with pytest.raises(InvalidArgumentError, match="skyrl-tx keys create --name NAME"):
            ServerSettings(base_model="tiny-qwen3", host=host).validate()
    for host in ("127.0.0.1", "::1", "localhost"):
        ServerSettings(base_model="tiny-qwen3", host=host).validate()
    ServerSettings(base_model="tiny-qwen3", host="0.0.0.0", auth="keys").validate()
    env = {**os.environ, "SKYRL_TX_DATA_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-m", "skyrl_tx.api", "--base-model", "tiny-qwen3", "--host", "0.0.0.0",
                             "--port", "1"], capture_output=True, text=True, env=env, timeout=60, cwd=REPO)
    assert result.returncode == 2
    assert "--host 0.0.0.0 is reachable from other machines" in result.stderr
    assert "`skyrl-tx keys create --name NAME`" in result.stderr and "--auth keys" in result.stderr
