"""kill -9 of the engine ten times at random moments of a pipelined training run: with binary request bodies and
recovery snapshots (every 3 optim steps here), the final losses and weights equal an undisturbed run's."""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import threading
import time
import urllib.request

import numpy as np
import pytest
import tinker
from tinker import types

from live_server import live_server

KILLS = 10
STEPS = 24
ADAM = types.AdamParams(learning_rate=1e-2)


def _engine_pid(url: str) -> int | None:
    with urllib.request.urlopen(f"{url}/api/v1/healthz", timeout=5) as response:
        return json.loads(response.read())["engine_pid"]


def _datum(step: int, row: int) -> types.Datum:
    tokens = [(7 * t + 13 * row + step) % 2000 + 5 for t in range(64)]
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})


def _run(client: tinker.TrainingClient) -> list[float]:
    """STEPS forward_backward + optim_step pairs, all submitted before any result is read."""
    futures = []
    for step in range(STEPS):
        futures.append(client.forward_backward([_datum(step, row) for row in range(4)], "cross_entropy"))
        client.optim_step(ADAM)
    return [float(sum(-np.asarray(o["logprobs"].tolist()).sum() for o in f.result().loss_fn_outputs)) for f in futures]


def _completed(database, model_id: str) -> int:
    with sqlite3.connect(database) as db:
        return db.execute("SELECT COUNT(*) FROM futures WHERE model_id = ? AND status = 'completed'",
                          (model_id,)).fetchone()[0]


def _killer(url: str, database, model_id: str, kills: list[int], stop: threading.Event) -> None:
    """Kills the engine whenever it has completed at least one more request since the last kill (so no request
    runs during MAX_ATTEMPTS crashes in a row), after a random delay."""
    rng, last = random.Random(1234), -1
    while len(kills) < KILLS and not stop.is_set():
        done, pid = _completed(database, model_id), _engine_pid(url)
        if pid is None or done <= last:
            time.sleep(0.02)
            continue
        time.sleep(rng.uniform(0.0, 0.3))
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        kills.append(pid)
        last = done
        while _engine_pid(url) in (pid, None) and not stop.is_set():  # until the supervisor restarted it
            time.sleep(0.05)


def test_ten_engine_kills_during_a_pipelined_run_change_nothing(monkeypatch, preset_cache) -> None:
    monkeypatch.setenv("TINKER_API_KEY", "tml-test")
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    # The restarts wait 0.2 s each, not the crash-loop back-off (0.2, 1, then 5 s per kill: ~40 s of sleeping here).
    with live_server(backend_config={"recovery_snapshot_every_steps": 3},
                     env={"SKYRL_TX_TEST_ENGINE_RESTART_DELAY_S": "0.2"}) as url:
        monkeypatch.setenv("TINKER_BASE_URL", url)
        database = url.log_path.parent / "skyrl_tx.db"
        with tinker.ServiceClient() as service:
            victim = service.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=7).result()
            kills: list[int] = []
            stop = threading.Event()
            killer = threading.Thread(target=_killer, args=(url, database, victim.model_id, kills, stop), daemon=True)
            killer.start()
            try:
                losses = _run(victim)
                while killer.is_alive() and len(kills) < KILLS:  # the run ended first: keep killing while idle
                    victim.forward([_datum(0, 0)], "cross_entropy").result()
            finally:
                stop.set()
                killer.join(60)
            assert len(kills) == KILLS, f"only {len(kills)} kills happened"
            final = victim.forward([_datum(99, 0)], "cross_entropy").result()

            reference = service.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=7).result()
            assert losses == pytest.approx(_run(reference), rel=1e-5)
            expected = reference.forward([_datum(99, 0)], "cross_entropy").result()
            assert final.loss_fn_outputs[0]["logprobs"].tolist() == pytest.approx(
                expected.loss_fn_outputs[0]["logprobs"].tolist(), rel=1e-5)
            log = url.log_tail(4000)
            assert "restored its recovery snapshot" in log  # the restarts did start from snapshots
