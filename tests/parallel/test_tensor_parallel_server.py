"""Through the real tinker SDK: a server started with --backend-config '{"tensor_parallel_size": 2}' (the engine and
one worker rank, each holding half of every layer's heads and MLP columns and half the vocabulary) trains two LoRA
tenants and a full fine-tune and samples exactly as a one-process server does; on two node processes as well
(`skyrl-tx worker` joining the coordinator as a second node would); and a kill -9 of the worker rank restarts the
group with the same weights."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from live_server import ServerUrl, free_port, live_server
from parallel_runs import TENANTS, assert_same_as_one_process_run, train_and_sample, worker_node

from skyrl_tx.bench.live_server import healthy

TP = {"tensor_parallel_size": 2, "recovery_snapshot_every_steps": 1}
LORA_TENANTS = (("a", 4, 1), ("b", 8, 2))


@pytest.fixture(scope="module")
def one_process_run(preset_cache) -> dict[str, Any]:
    with live_server() as url:
        return train_and_sample(url)


@pytest.fixture(scope="module")
def tp_server(preset_cache) -> Iterator[ServerUrl]:
    """One TP=2 server for the equality test and, after it, the kill test (each in a session of its own, whose models
    unload when it closes): one start of a 2-rank group instead of two."""
    with live_server(backend_config=TP) as url:
        yield url


def test_tensor_parallel_server_equals_one_process(tp_server: ServerUrl, one_process_run) -> None:
    url = tp_server
    assert "parallel: 2 ranks (1 data-parallel x 2 tensor-parallel)" in url.log_tail(400), url.log_tail()
    got = train_and_sample(url, tenants=TENANTS)
    assert set(got["losses"]) == {"a", "b", "full"}
    assert_same_as_one_process_run(got, one_process_run)


@pytest.mark.parametrize(("preset", "split"), [("tiny-deepseek-v3", {"expert_parallel_size": 2}),
                                               ("tiny-qwen3.5", {})])
def test_every_architecture_family_serves_split(preset_cache, preset: str, split: dict) -> None:
    """DeepSeek V3 (MLA, experts spread over the ranks) and Qwen3.5 (Gated DeltaNet) under TP=2 train and sample
    through the SDK exactly as one process serving them does."""
    with live_server(base_model=preset) as url:
        one_process = train_and_sample(url, tenants=TENANTS, base_model=preset)
    with live_server(base_model=preset, backend_config={**TP, **split}) as url:
        assert "parallel: 2 ranks (1 data-parallel x 2 tensor-parallel)" in url.log_tail(), url.log_tail()
        got = train_and_sample(url, tenants=TENANTS, base_model=preset)
    assert set(got["losses"]) == {"a", "b", "full"}
    assert_same_as_one_process_run(got, one_process)


def test_killing_a_tensor_parallel_rank_restarts_the_group_with_the_same_weights(tp_server: ServerUrl,
                                                                                 one_process_run) -> None:
    """kill -9 of the worker rank (half of every layer) after the full fine-tune's second step: the engine's next
    collective fails, the group restarts, every rank restores its part of the newest recovery snapshot (weights and
    AdamW moments), and the run ends as an undisturbed one."""
    url = tp_server
    assert "broke the group" not in url.log_tail(4000)  # the group's first break is this test's kill
    got = train_and_sample(url, kill_after=("full", 1), kill="worker", tenants=TENANTS)
    assert healthy(url)
    assert "broke the group" in url.log_tail(400), url.log_tail()
    assert_same_as_one_process_run(got, one_process_run)


def test_tensor_parallel_over_two_node_processes(preset_cache, one_process_run) -> None:
    """The seed README's multi-node form: the engine's node runs rank 0, `skyrl-tx worker --process-id 1` rank 1."""
    port = free_port()
    config = {"tensor_parallel_size": 2, "num_processes": 2, "coordinator_address": f"127.0.0.1:{port}"}
    node = worker_node(port, 1, 2, 2, config=config)
    try:
        with live_server(backend_config=config) as url:
            assert "parallel: 2 ranks (1 data-parallel x 2 tensor-parallel) over 2 node process(es)" in \
                url.log_tail(), url.log_tail()
            got = train_and_sample(url, tenants=LORA_TENANTS)
    finally:
        node.kill()
        node.wait(30)
    assert_same_as_one_process_run(got, one_process_run)
