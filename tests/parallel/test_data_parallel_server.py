"""Through the real tinker SDK: a server started with --backend-config '{"fully_sharded_data_parallel_size": 2}'
(the engine plus one worker rank, Gloo) trains two LoRA tenants and a full fine-tune (ZeRO-sharded) and samples
exactly as a one-process server does, both ranks decoding a share of the samples (parallel/sampling_share.py); and a
kill -9 of the engine takes its worker rank down with it and the restarted group goes on with the same weights
(rebuilt from a recovery snapshot: every rank's optimizer state)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from live_server import free_port, live_server
from parallel_runs import sample_concurrently, train_and_sample, worker_node

from skyrl_tx.bench.live_server import healthy

# A recovery snapshot after every step: a restarted group rebuilds from one (weights and AdamW state on every rank).
DP = {"fully_sharded_data_parallel_size": 2, "recovery_snapshot_every_steps": 1}


@pytest.fixture(scope="module")
def one_process_run(preset_cache) -> dict[str, Any]:
    with live_server() as url:
        return {**train_and_sample(url), "sampling": sample_concurrently(url)}


def test_data_parallel_server_equals_one_process(preset_cache, one_process_run, tmp_path: Path) -> None:
    """Also: many samples at once (greedy and seeded, num_samples > 1, base model and a LoRA snapshot) give one
    process's tokens with both ranks decoding, and two unseeded ones on different replicas differ."""
    with live_server(backend_config=DP, data_dir=tmp_path) as url:
        assert "parallel: 2 ranks (2 data-parallel x 1 tensor-parallel)" in url.log_tail(), url.log_tail()
        got = train_and_sample(url)
        sampled = sample_concurrently(url)
    for name, losses in one_process_run["losses"].items():
        assert got["losses"][name] == pytest.approx(losses, rel=1e-5), name
    assert got["tokens"] == one_process_run["tokens"]
    assert sampled["tokens"] == one_process_run["sampling"]["tokens"]
    assert sampled["unseeded"][0] != sampled["unseeded"][1], "two replicas drew the same unseeded samples"
    # Read after the stop (data_dir outlives the server): each rank says at exit how many sequences it decoded.
    log = url.log_tail(100_000)
    worker = re.search(r"rank 1 stops: it decoded (\d+) sampled sequences", log)
    per_replica = re.search(r"sequences decoded per replica \[(\d+), (\d+)\]", log)
    assert worker is not None and per_replica is not None, log[-4000:]
    assert int(worker[1]) == int(per_replica[2]) > 0 and int(per_replica[1]) > 0, (worker[0], per_replica[0])
    sequences = len(one_process_run["tokens"]) + sum(len(s) for s in sampled["tokens"].values()) + 2
    assert int(per_replica[1]) + int(per_replica[2]) == sequences


@pytest.mark.parametrize("kill,after", [("engine", ("a", 1)), ("worker", ("full", 1))])
def test_killing_a_rank_restarts_the_whole_group_with_the_same_weights(preset_cache, one_process_run,
                                                                       kill: str, after: tuple[str, int]) -> None:
    """kill -9 of rank 0 (the engine) mid-way through a LoRA tenant's steps, or of the worker rank mid-way through
    the full fine-tune's: the group restarts, every rank restores the newest recovery snapshot's weights and
    optimizer state (its ZeRO range for the full model), recovery reruns what was running, and the run ends as an
    undisturbed one (no request lost or applied twice)."""
    with live_server(backend_config=DP) as url:
        got = train_and_sample(url, kill_after=after, kill=kill)
        assert healthy(url)
        if kill == "worker":
            assert "broke the group" in url.log_tail(400), url.log_tail()
    for name, losses in one_process_run["losses"].items():
        assert got["losses"][name] == pytest.approx(losses, rel=1e-5), name
    assert got["tokens"] == one_process_run["tokens"]


def test_worker_nodes_joining_a_coordinator_train_as_one_process(preset_cache, one_process_run) -> None:
    """As two more nodes would: `skyrl-tx worker --process-id 1|2` join the engine's coordinator address."""
    port = free_port()
    nodes = [worker_node(port, i, 3, 3) for i in (1, 2)]
    try:
        config = {"fully_sharded_data_parallel_size": 3, "num_processes": 3, "coordinator_address": f"127.0.0.1:{port}"}
        with live_server(backend_config=config) as url:
            assert "parallel: 3 ranks (3 data-parallel x 1 tensor-parallel) over 3 node process(es)" in \
                url.log_tail(), url.log_tail()
            got = train_and_sample(url)
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
    node = worker_node(port, 1, 2, 2, base_model="tiny-llama3")
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
