"""Through the real tinker SDK: a server started with --backend-config '{"fully_sharded_data_parallel_size": 2}'
(the engine plus one worker rank, Gloo) trains two LoRA tenants and a full fine-tune (ZeRO-sharded) and samples
exactly as a one-process server does; and a kill -9 of the engine takes its worker rank down with it and the
restarted group goes on with the same weights (rebuilt from a recovery snapshot: every rank's optimizer state)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
from engine_processes import process_state, spawned_children
from live_server import free_port, live_server

from skyrl_tx.bench.api import _engine_pid
from skyrl_tx.bench.live_server import healthy

# A recovery snapshot after every step: a restarted group rebuilds from one (weights and AdamW state on every rank).
DP = {"fully_sharded_data_parallel_size": 2, "recovery_snapshot_every_steps": 1}
STEPS = 4


def _train_and_sample(url: str, kill_after: tuple[str, int] | None = None, kill: str = "engine") -> dict[str, Any]:
    """Two LoRA tenants (ranks 4 and 8) and a full fine-tune (rank 0), fixed seeds, train STEPS steps on ragged
    batches, then sample greedily."""
    import tinker
    from tinker import types

    os.environ.update(TINKER_BASE_URL=url, TINKER_API_KEY="tml-dp", TINKER_TELEMETRY="0")
    out: dict[str, Any] = {"losses": {}, "tokens": {}}
    with tinker.ServiceClient() as service:
        clients = {name: service.create_lora_training_client(base_model="tiny-qwen3", rank=rank, seed=seed).result()
                   for name, rank, seed in (("a", 4, 1), ("b", 8, 2), ("full", 0, 3))}
        for name, client in clients.items():
            losses = []
            for step in range(STEPS):
                # 3 or 5 rows of different lengths: no multiple of the rank count, unequal tokens
                data = [types.Datum(model_input=types.ModelInput.from_ints(list(range(5 + i, 5 + i + n))),
                                    loss_fn_inputs={"target_tokens": list(range(6 + i, 6 + i + n)),
                                                    "weights": [1.0] * n})
                        for i, n in enumerate([9, 4, 13, 6, 2][: 3 + 2 * (step % 2)])]
                losses.append(client.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
                lr = 1e-3 if name == "full" else 1e-2
                client.optim_step(types.AdamParams(learning_rate=lr)).result()
                if kill_after == (name, step):
                    engine = _engine_pid(url)
                    workers = spawned_children(engine)
                    assert workers, "the data-parallel engine has no worker rank"
                    os.kill(engine if kill == "engine" else workers[0], signal.SIGKILL)
                    deadline = time.monotonic() + 30
                    while kill == "engine" and any(os.path.exists(f"/proc/{w}") and process_state(w) != "Z"
                                                   for w in workers):
                        assert time.monotonic() < deadline, "the worker rank outlived its engine"
                        time.sleep(0.2)
            out["losses"][name] = losses
            sampler = client.save_weights_and_get_sampling_client().result()
            result = sampler.sample(types.ModelInput.from_ints([5, 6, 7, 8]), 1,
                                    types.SamplingParams(max_tokens=12, temperature=0.0)).result()
            out["tokens"][name] = list(result.sequences[0].tokens)
    return out


@pytest.fixture(scope="module")
def one_process_run(preset_cache) -> dict[str, Any]:
    with live_server() as url:
        return _train_and_sample(url)


def test_data_parallel_server_equals_one_process(preset_cache, one_process_run) -> None:
    with live_server(backend_config=DP) as url:
        assert "data parallel: 2 ranks" in url.log_tail(), url.log_tail()
        got = _train_and_sample(url)
    for name, losses in one_process_run["losses"].items():
        assert got["losses"][name] == pytest.approx(losses, rel=1e-5), name
    assert got["tokens"] == one_process_run["tokens"]


@pytest.mark.parametrize("kill,after", [("engine", ("a", 1)), ("worker", ("full", 1))])
def test_killing_a_rank_restarts_the_whole_group_with_the_same_weights(preset_cache, one_process_run,
                                                                       kill: str, after: tuple[str, int]) -> None:
    """kill -9 of rank 0 (the engine) mid-way through a LoRA tenant's steps, or of the worker rank mid-way through
    the full fine-tune's: the group restarts, every rank restores the newest recovery snapshot's weights and
    optimizer state (its ZeRO range for the full model), recovery reruns what was running, and the run ends as an
    undisturbed one (no request lost or applied twice)."""
    with live_server(backend_config=DP) as url:
        got = _train_and_sample(url, kill_after=after, kill=kill)
        assert healthy(url)
        if kill == "worker":
            assert "broke the group" in url.log_tail(400), url.log_tail()
    for name, losses in one_process_run["losses"].items():
        assert got["losses"][name] == pytest.approx(losses, rel=1e-5), name
    assert got["tokens"] == one_process_run["tokens"]


def _worker_node(port: int, process_id: int, processes: int, world: int, base_model: str = "tiny-qwen3") -> Any:
    import json
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-m", "skyrl_tx.cli", "worker", "--coordinator-address",
                             f"127.0.0.1:{port}", "--num-processes", str(processes), "--process-id", str(process_id),
                             "--base-model", base_model, "--backend-config",
                             json.dumps({"fully_sharded_data_parallel_size": world})],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_worker_nodes_joining_a_coordinator_train_as_one_process(preset_cache, one_process_run) -> None:
    """As two more nodes would: `skyrl-tx worker --process-id 1|2` join the engine's coordinator address."""
    port = free_port()
    nodes = [_worker_node(port, i, 3, 3) for i in (1, 2)]
    try:
        config = {"fully_sharded_data_parallel_size": 3, "num_processes": 3, "coordinator_address": f"127.0.0.1:{port}"}
        with live_server(backend_config=config) as url:
            assert "data parallel: 3 ranks over 3 node process(es)" in url.log_tail(), url.log_tail()
            got = _train_and_sample(url)
    finally:
        for node in nodes:
            node.kill()
            node.wait(30)
    for name, losses in one_process_run["losses"].items():
        assert got["losses"][name] == pytest.approx(losses, rel=1e-5), name
    assert got["tokens"] == one_process_run["tokens"]


def test_a_node_with_another_model_is_refused_by_name(preset_cache) -> None:
    """A worker node started with a different checkpoint stops with exit code 2, naming what differs."""
    port = free_port()
    node = _worker_node(port, 1, 2, 2, base_model="tiny-llama3")
    config = {"fully_sharded_data_parallel_size": 2, "num_processes": 2, "coordinator_address": f"127.0.0.1:{port}"}
    try:
        with pytest.raises(Exception):  # the engine refuses too: the server never gets ready
            with live_server(backend_config=config, startup_timeout_s=60):
                pass
        output, _ = node.communicate(timeout=60)
    finally:
        node.kill()
    assert node.returncode == 2, output
    assert "rank 1 differs from rank 0 in model" in output, output
