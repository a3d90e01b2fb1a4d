"""After a restart the server answers at once, before its engine has rebuilt the live models: healthz says the
engine is not ready, training calls are accepted and wait in the queue, and once the engine recovered they run
on the rebuilt model exactly as on a server that never restarted.

The restarted server's engine is held back by a test-only start gate (SKYRL_TX_TEST_ENGINE_START_GATE,
engine/process.py), so "not ready yet" is a certainty, not a race. Raw HTTP: the model outlives the first server's
SDK session, which a ServiceClient would finish (and unload) on close."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from live_server import REPO, free_port, live_server
from tinker import types
from tinker.proto import request_conv

from skyrl_tx.engine.process import START_GATE_ENV

HEADERS = {"X-API-Key": "tml-test"}
PROTOBUF = "application/x-protobuf"
ADAM = {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0, "grad_clip_norm": 0.0}
TOKENS = [5, 17, 300, 42, 7, 99, 1000, 3]
STEPS_BEFORE = 3  # forward_backward + optim_step pairs of history before the restart


def data() -> list[types.Datum]:
    return [types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]),
                        loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)})]


class Client:
    """One model driven over raw HTTP, with its own seq_id counter."""

    def __init__(self, http: httpx.Client, model_id: str) -> None:
        self.http, self.model_id, self.seq = http, model_id, 0

    @classmethod
    def create(cls, http: httpx.Client, seed: int) -> Client:
        session = http.post("/api/v1/create_session", json={"tags": [], "user_metadata": {}}).json()["session_id"]
        r = http.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 0, "base_model": "tiny-qwen3",
                                                    "lora_config": {"rank": 4, "seed": seed}})
        assert r.status_code == 200, r.text
        client = cls(http, r.json()["model_id"])
        client.wait(r.json()["request_id"])
        return client

    def submit_fb(self, forward_only: bool = False) -> str:
        self.seq += 1
        request = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(
            data=data(), loss_fn="cross_entropy"), model_id=self.model_id, seq_id=self.seq)
        message = request_conv.forward_backward_request_to_proto(request)
        message.forward_only = forward_only
        r = self.http.post("/api/v1/forward_backward", content=message.SerializeToString(),
                           headers={"Content-Type": PROTOBUF})
        assert r.status_code == 200, r.text
        return r.json()["request_id"]

    def submit_step(self) -> str:
        self.seq += 1
        r = self.http.post("/api/v1/optim_step", json={"model_id": self.model_id, "seq_id": self.seq,
                                                       "adam_params": ADAM})
        assert r.status_code == 200, r.text
        return r.json()["request_id"]

    def wait(self, request_id: str, timeout_s: float = 120) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            r = self.http.post("/api/v1/retrieve_future", json={"request_id": request_id})
            assert r.status_code == 200, r.text
            if r.json().get("type") != "try_again":
                assert "error" not in r.json(), r.json()
                return r.json()
        raise AssertionError(f"{request_id} did not finish in {timeout_s} s")

    def train(self, steps: int) -> None:
        for _ in range(steps):
            self.submit_fb()
            self.wait(self.submit_step())

    def loss(self) -> float:
        return self.wait(self.submit_fb(forward_only=True))["metrics"]["loss:sum"]


@pytest.fixture
def data_dir(preset_cache: Path) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="skyrl_tx_restart_at_once_"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _new_server_url(data_dir: Path, known: set[Path], timeout_s: float = 60) -> str:
    """The restarted server's URL, from the log file live_server names after its port, once healthz answers."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for log in set(data_dir.glob("server-*.log")) - known:
            port = re.fullmatch(r"server-(\d+)\.log", log.name).group(1)
            url = f"http://127.0.0.1:{port}"
            try:
                if httpx.get(f"{url}/api/v1/healthz", timeout=2).status_code == 200:
                    return url
            except httpx.TransportError:
                pass
        time.sleep(0.05)
    raise AssertionError(f"the restarted server did not answer healthz within {timeout_s} s")


def test_restarted_server_serves_before_its_engine_recovered(data_dir: Path) -> None:
    with live_server(data_dir=data_dir) as url, httpx.Client(base_url=url, headers=HEADERS, timeout=60) as http:
        client = Client.create(http, seed=7)
        client.train(STEPS_BEFORE)
        loss_before = client.loss()
        model_id, seq = client.model_id, client.seq

    gate = data_dir / "engine-start-gate"
    known = set(data_dir.glob("server-*.log"))
    restarted: dict[str, Any] = {}
    up, done = threading.Event(), threading.Event()

    def serve() -> None:  # live_server returns only once the engine is ready: it waits here, on its own thread
        try:
            with live_server(data_dir=data_dir, env={START_GATE_ENV: str(gate)}) as restarted_url:
                restarted["url"] = restarted_url
                up.set()
                done.wait()
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            restarted["error"] = exc
            up.set()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        url = _new_server_url(data_dir, known)
        with httpx.Client(base_url=url, headers=HEADERS, timeout=60) as http:
            health = http.get("/api/v1/healthz").json()
            assert health["status"] == "ok" and health["engine_ready"] is False, health
            # training calls are accepted while the model is not rebuilt: they wait in the queue
            client = Client(http, model_id)
            client.seq = seq
            loss_id = client.submit_fb(forward_only=True)
            client.submit_fb()
            step_id = client.submit_step()
            assert http.get("/api/v1/healthz").json()["engine_ready"] is False  # all of it before recovery

            gate.touch()  # the engine starts, rebuilds the model from its history, then runs the queue
            assert up.wait(120) and "error" not in restarted, restarted.get("error")
            assert http.get("/api/v1/healthz").json()["engine_ready"] is True
            assert client.wait(loss_id)["metrics"]["loss:sum"] == pytest.approx(loss_before, rel=1e-6)
            assert client.wait(step_id)["metrics"]["grad_norm"] > 0
            loss_after = client.loss()

            # the same history on a model that never saw a restart gives the same weights
            twin = Client.create(http, seed=7)
            twin.train(STEPS_BEFORE + 1)
            assert twin.loss() == pytest.approx(loss_after, rel=1e-6)
            assert loss_after < loss_before
    finally:
        gate.touch()
        done.set()
        thread.join(60)


def test_an_engine_that_cannot_start_stops_the_server(data_dir: Path, preset_cache: Path) -> None:
    """Serving at once must not hide a configuration the engine cannot run (no such device): the server says why
    and exits non-zero, as it did when it waited for the engine before serving."""
    env = {**os.environ, "SKYRL_TX_DATA_DIR": str(data_dir), "SKYRL_TX_CACHE_DIR": str(preset_cache)}
    result = subprocess.run([sys.executable, "-m", "skyrl_tx.api", "--base-model", "tiny-qwen3", "--port",
                             str(free_port()), "--backend-config", '{"device": "cuda:99"}'],
                            capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    assert result.returncode != 0
    assert "the engine could not load the base model" in result.stderr + result.stdout
