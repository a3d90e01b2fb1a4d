"""The engine as a separate process: killed mid-run it is restarted and nothing is lost or run twice;
`--engine external` with a standalone `skyrl-tx engine` serves the same API."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pytest
import tinker
from live_server import REPO, live_server
from tinker import types

TOKENS = list(range(5, 29))
STEPS = 30
ROWS, LENGTH = 16, 128
GREEDY = types.SamplingParams(max_tokens=8, temperature=0.0)


def health(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/api/v1/healthz", timeout=5) as response:
        return json.loads(response.read())


def datum(step: int, row: int = 0) -> types.Datum:
    tokens = [(7 * t + 13 * row + step) % 2000 + 5 for t in range(LENGTH)]
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})


def batch(step: int) -> list[types.Datum]:
    """Big enough that the engine is still busy with the queue when it is killed."""
    return [datum(step, row) for row in range(ROWS)]


def loss(result) -> float:
    return float(sum(-np.asarray(out["logprobs"].tolist()).sum() for out in result.loss_fn_outputs))


def submit_steps(client: tinker.TrainingClient) -> list:
    """Every step submitted without waiting (the SDK keeps their seq_id order)."""
    futures = []
    for step in range(STEPS):
        futures.append(client.forward_backward(batch(step), "cross_entropy"))
        client.optim_step(types.AdamParams(learning_rate=1e-2))
    return futures


def wait_until_mid_run(database: Path, model_id: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with sqlite3.connect(database) as db:
            counts = dict(db.execute("SELECT status, COUNT(*) FROM futures WHERE model_id = ? GROUP BY status",
                                     (model_id,)).fetchall())
        # The SDK submits one request at a time, so "mid-run" = some done, others not even submitted yet.
        if 6 <= counts.get("completed", 0) <= STEPS:
            return
        time.sleep(0.005)
    pytest.fail(f"the engine never was mid-run on {model_id}: {counts}")


@pytest.fixture()
def sdk_env(monkeypatch) -> None:
    monkeypatch.setenv("TINKER_API_KEY", "tml-test")
    monkeypatch.setenv("TINKER_TELEMETRY", "0")


def test_killing_the_engine_mid_run_loses_nothing(sdk_env, monkeypatch, preset_cache) -> None:
    with live_server() as url:
        monkeypatch.setenv("TINKER_BASE_URL", url)
        first_pid = health(url)["engine_pid"]
        assert first_pid and health(url)["engine"] == "process"
        with tinker.ServiceClient() as service:
            victim = service.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=7).result()
            warmup = victim.forward_backward([datum(0)], "cross_entropy").result()  # state before the kill
            victim.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            sampler = victim.save_weights_and_get_sampling_client()  # waits for every earlier request: take it first
            futures = submit_steps(victim)
            sample = sampler.sample(types.ModelInput.from_ints(TOKENS[:6]), 1, GREEDY)
            database = url.log_path.parent / "skyrl_tx.db"
            wait_until_mid_run(database, victim.model_id)  # some of the queue done, most of it still waiting ...
            os.kill(first_pid, signal.SIGKILL)  # ... when the engine dies without warning
            killed_at = datetime.now(timezone.utc)
            losses = [loss(f.result()) for f in futures]
            sampled = sample.result().sequences[0].tokens
            after = health(url)
            assert after["engine_restarts"] >= 1 and after["engine_pid"] not in (None, first_pid)

            # The same work on a fresh model in the restarted engine: a lost or repeated forward_backward or
            # optim_step of the victim would change its losses.
            reference = service.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=7).result()
            assert loss(reference.forward_backward([datum(0)], "cross_entropy").result()) == pytest.approx(loss(warmup))
            reference.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            expected = [loss(f.result()) for f in submit_steps(reference)]
            assert losses == pytest.approx(expected, rel=1e-5)
            assert "engine process" in url.log_tail(400) and "restarting" in url.log_tail(400)
            assert len(sampled) == 8
            assert "rebuilt from its request log" in url.log_tail(400)
        # The kill really was mid-run: some of the victim's requests completed only in the restarted engine.
        with sqlite3.connect(database) as db:
            rows = db.execute("SELECT completed_at, status FROM futures WHERE model_id = ? AND request_type != "
                              "'unload_model'", (victim.model_id,)).fetchall()  # closing the client unloads it
        assert len(rows) == 3 + 2 * STEPS and all(status == "completed" for _, status in rows)
        later = [r for r in rows if datetime.fromisoformat(r[0]).replace(tzinfo=timezone.utc) > killed_at]
        assert later, f"every request finished before the kill ({killed_at}): {sorted(r[0] for r in rows)[-3:]}"


def test_external_engine_serves_the_api(sdk_env, monkeypatch, preset_cache, tmp_path) -> None:
    database_url = f"sqlite:///{tmp_path / 'shared.db'}"
    checkpoints = str(tmp_path / "checkpoints")
    engine_log = open(tmp_path / "engine.log", "wb")
    engine = subprocess.Popen([sys.executable, "-m", "skyrl_tx.cli", "engine", "--base-model", "tiny-qwen3",
                               "--database-url", database_url, "--checkpoints-base", checkpoints],
                              stdout=engine_log, stderr=subprocess.STDOUT, cwd=REPO,
                              env={**os.environ, "SKYRL_TX_CACHE_DIR": str(preset_cache)})
    try:
        extra = ["--engine", "external", "--checkpoints-base", checkpoints]
        with live_server(database_url=database_url, extra_args=extra) as url:
            monkeypatch.setenv("TINKER_BASE_URL", url)
            assert health(url)["engine"] == "external"
            with tinker.ServiceClient() as service:
                client = service.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=1).result()
                first = loss(client.forward_backward([datum(0)], "cross_entropy").result())
                client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
                assert loss(client.forward_backward([datum(0)], "cross_entropy").result()) < first
                path = client.save_weights_for_sampler("external").result().path
                tokens = service.create_sampling_client(model_path=path).result().sample(
                    types.ModelInput.from_ints(TOKENS[:4]), 1, GREEDY).result().sequences[0].tokens
                assert len(tokens) == 8
        assert engine.poll() is None, Path(tmp_path / "engine.log").read_text()[-3000:]
    finally:
        engine.send_signal(signal.SIGINT)
        try:
            engine.wait(15)
        except subprocess.TimeoutExpired:
            engine.kill()
        engine_log.close()


def test_thread_engine_serves_the_api(sdk_env, monkeypatch, preset_cache) -> None:
    with live_server(extra_args=["--engine", "thread"]) as url:
        monkeypatch.setenv("TINKER_BASE_URL", url)
        assert health(url)["engine"] == "thread" and health(url)["engine_pid"] is None
        with tinker.ServiceClient() as service:
            client = service.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=1).result()
            first = loss(client.forward_backward(batch(0), "cross_entropy").result())
            client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            assert loss(client.forward_backward(batch(0), "cross_entropy").result()) < first
