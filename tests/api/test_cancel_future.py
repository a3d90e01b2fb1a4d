"""cancel_future through a live server: a request still pending fails with a "cancelled" user error and never runs;
a cancelled training request's seq_id is used up, so the model's later requests run, in order, without it; one
running or finished is left be; create/unload requests are refused. The SDK sends it for a sample it stops waiting
for (dynamic config sample_cancel_enabled): with an engine that has not started yet, that sample never runs.

Pending is made deterministic, never a race: a training request waits behind a seq_id gap (the engine never skips
one), and samples wait while no engine runs (`--engine external`, the engine started afterwards)."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from typing import Any

import httpx
import pytest
import tinker
from live_server import REPO, live_server
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from sdk_training import datum
from raw_futures import retrieve

BASE_MODEL = "tiny-qwen3"
API_KEY = "tml-test"  # any key of the SDK's shape: the server runs with --auth none
ADAM = {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0, "grad_clip_norm": 0.0}
TIMEOUT_S = 120



def cancel(http: httpx.Client, request_id: str) -> dict[str, Any]:
    r = http.post("/api/v1/cancel_future", json={"request_id": request_id})
    assert r.status_code == 200, r.text
    return r.json()


def forward_backward(http: httpx.Client, model_id: str, seq_id: int, data: list[types.Datum]) -> str:
    request = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(
        data=data, loss_fn="cross_entropy"), model_id=model_id, seq_id=seq_id)
    r = http.post("/api/v1/forward_backward", content=forward_backward_request_to_proto(request).SerializeToString(),
                  headers={"Content-Type": "application/x-protobuf"})
    assert r.status_code == 200, r.text
    return r.json()["request_id"]


def test_a_cancelled_pending_training_request_never_runs_and_later_ones_run_in_order(service_client: Any,
                                                                                    http: httpx.Client) -> None:
    model_id = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=1).result().model_id
    # seq 2 arrives before seq 1: it waits for it, so it is certainly still pending when it is cancelled.
    gone = forward_backward(http, model_id, 2, [datum(11)])
    answer = cancel(http, gone)
    assert answer["cancelled"] is True and answer["status"] == "failed", answer
    failure = retrieve(http, gone)
    assert failure["category"] == "user" and "cancelled" in failure["error"] and "did not run" in failure["error"]
    again = cancel(http, gone)  # nothing changes: it is finished (failed)
    assert again["cancelled"] is False and again["status"] == "failed" and "already finished" in again["message"]
    first = forward_backward(http, model_id, 1, [datum(0)])
    step = http.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": 3, "adam_params": ADAM}).json()
    assert "loss_fn_outputs" in retrieve(http, first)
    step_result = retrieve(http, step["request_id"])  # seq 3 ran: it did not wait for the cancelled seq 2
    # The same model without seq 2: the step saw exactly seq 1's gradients, so seq 2 never ran.
    reference = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=1).result()
    reference.forward_backward([datum(0)], "cross_entropy").result()
    expected = reference.optim_step(types.AdamParams(**ADAM)).result().metrics
    assert step_result["metrics"]["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-6)
    done = cancel(http, first)
    assert done["cancelled"] is False and done["status"] == "completed", done


def test_create_requests_cannot_be_cancelled(service_client: Any, http: httpx.Client) -> None:
    model_id = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=2).result().model_id
    r = http.post("/api/v1/cancel_future", json={"request_id": f"{model_id}:create"})
    assert r.status_code == 409 and "cannot be cancelled" in r.json()["message"], r.text


# ---- samples, with no engine running yet -----------------------------------------------------------------------
def rows(database: str, where: str) -> list[tuple]:
    with sqlite3.connect(database) as db:
        return db.execute(f"SELECT id, status, attempts, started_at FROM futures WHERE {where} ORDER BY id").fetchall()


def wait_for_row(database: str, where: str) -> list[tuple]:
    """The SDK sends its asample in the background: the test goes on once the server has stored it."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        found = rows(database, where)
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"no future where {where} within {TIMEOUT_S} s")


def test_a_sample_the_sdk_stops_waiting_for_is_cancelled_and_never_runs(monkeypatch, preset_cache, tmp_path) -> None:
    database = tmp_path / "shared.db"
    database_url, checkpoints = f"sqlite:///{database}", str(tmp_path / "checkpoints")
    extra = ["--engine", "external", "--checkpoints-base", checkpoints]
    engine = None
    with live_server(database_url=database_url, extra_args=extra) as url:
        for name, value in {"TINKER_BASE_URL": url, "TINKER_API_KEY": API_KEY, "TINKER_TELEMETRY": "0"}.items():
            monkeypatch.setenv(name, value)
        try:
            with tinker.ServiceClient() as service, httpx.Client(base_url=url, timeout=60) as http:
                assert http.post("/api/v1/client/dynamic_config", json={}).json()["sample_cancel_enabled"] is True
                sampler = service.create_sampling_client(base_model=BASE_MODEL).result()  # the API alone serves it
                prompt, greedy = types.ModelInput.from_ints([5, 6, 7]), types.SamplingParams(max_tokens=3,
                                                                                           temperature=0.0)
                abandoned = sampler.sample(prompt, 1, greedy)
                (abandoned_id, *_), = wait_for_row(str(database), "request_type = 'sample'")
                abandoned.future().cancel()  # the SDK gives up on it and tells the server
                failure = retrieve(http, abandoned_id)  # answered when the cancel lands
                assert failure["category"] == "user" and "cancelled" in failure["error"], failure
                # The same through the wire, and the session's completion queue reports both as failed.
                sampling_session_id = abandoned_id.rpartition(":")[0]
                raw = http.post("/api/v1/asample", json={
                    "sampling_session_id": sampling_session_id, "seq_id": 7, "num_samples": 1,
                    "prompt": {"chunks": [{"tokens": [5, 6, 7]}]}}).json()["request_id"]
                assert cancel(http, raw)["cancelled"] is True
                queue = http.post("/api/v1/retrieve_futures", json={"timeout": 0, "target": {
                    "type": "sampling_session", "sampling_session_id": sampling_session_id}}).json()
                assert sorted(queue["completions"], key=lambda c: c["request_id"]) == [
                    {"state": "failed", "request_id": abandoned_id}, {"state": "failed", "request_id": raw}]

                engine = subprocess.Popen(
                    [sys.executable, "-m", "skyrl_tx.cli", "engine", "--base-model", BASE_MODEL, "--database-url",
                     database_url, "--checkpoints-base", checkpoints], stdout=open(tmp_path / "engine.log", "wb"),
                    stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ, "SKYRL_TX_CACHE_DIR": str(preset_cache)})
                kept = sampler.sample(prompt, 1, greedy).result(timeout=TIMEOUT_S)  # the engine runs what is left
                assert len(kept.sequences[0].tokens) == 3
                # Its scan saw the cancelled ones before it ran this one: they stay failed, never claimed.
                assert [(status, attempts, started) for _, status, attempts, started in
                        rows(str(database), f"id IN ('{abandoned_id}', '{raw}')")] == [("failed", 0, None)] * 2
                assert "cancelled" in retrieve(http, abandoned_id)["error"]
        finally:
            if engine is not None:
                engine.send_signal(signal.SIGINT)
                try:
                    engine.wait(15)
                except subprocess.TimeoutExpired:
                    engine.kill()
