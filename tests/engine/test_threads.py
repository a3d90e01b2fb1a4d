"""The engine's thread-pool policy: counts chosen for given affinity masks, devices, the num_threads key and
OMP_NUM_THREADS; and real engine processes that log what they chose and what torch then runs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from skyrl_tx.config import BackendSettings
from skyrl_tx.db import migrate
from skyrl_tx.engine.settings import EngineSettings
from skyrl_tx.engine.threads import API_CORES, GPU_THREADS, choose_threads
from skyrl_tx.errors import InvalidArgumentError

START_TIMEOUT_S = 180


@pytest.mark.parametrize(("cores", "expected"), [(1, 1), (2, 1), (4, 3), (16, 15), (64, 63)])
def test_cpu_default_is_the_affinity_mask_less_the_api(cores: int, expected: int) -> None:
    choice = choose_threads("cpu", cores=cores, environ={})
    assert (choice.intra_op, choice.inter_op, choice.source) == (expected, 1, "default")
    assert f"{cores} cores in the affinity mask, {API_CORES} kept for the API" in choice.reason
    assert choice.env["OMP_NUM_THREADS"] == choice.env["MKL_NUM_THREADS"] == str(expected)


@pytest.mark.parametrize(("cores", "ranks"), [(2, 2), (8, 2), (16, 4), (17, 3), (64, 8)])
def test_local_ranks_split_the_cores_without_oversubscribing(cores: int, ranks: int) -> None:
    choice = choose_threads("cpu", cores=cores, environ={}, local_ranks=ranks)
    assert choice.intra_op >= 1
    if cores - API_CORES >= ranks:  # enough cores for one each: together they fit beside the API
        assert choice.intra_op * ranks <= cores - API_CORES
    assert "split between" in choice.reason


@pytest.mark.parametrize(("device", "cores", "expected"), [("cuda", 2, 1), ("cuda:1", 3, 2), ("cuda", 64, GPU_THREADS)])
def test_gpu_default_is_a_small_fixed_number(device: str, cores: int, expected: int) -> None:
    assert choose_threads(device, cores=cores, environ={}).intra_op == expected


def test_num_threads_key_beats_the_default_and_omp_num_threads_beats_both() -> None:
    by_key = choose_threads("cpu", 6, cores=2, environ={})
    assert (by_key.intra_op, by_key.source) == (6, "num_threads")
    by_env = choose_threads("cpu", 6, cores=2, environ={"OMP_NUM_THREADS": "3"})
    assert (by_env.intra_op, by_env.source) == (3, "OMP_NUM_THREADS")
    # An unusable OMP_NUM_THREADS (empty, zero, a list) is not an explicit count: the policy decides.
    for raw in ("", "0", "4,2"):
        assert choose_threads("cpu", cores=8, environ={"OMP_NUM_THREADS": raw}).intra_op == 7


def test_a_child_of_an_engine_chooses_its_own_share_but_a_user_setting_still_wins() -> None:
    parent = choose_threads("cpu", cores=16, environ={})
    inherited = {**parent.env}  # what a rank started by the engine sees
    child = choose_threads("cpu", cores=16, environ=inherited, local_ranks=3)
    assert (parent.intra_op, child.intra_op, child.source) == (15, 5, "default")
    assert child.env["MKL_NUM_THREADS"] == "5" and "PASSIVE" in child.describe()
    user = choose_threads("cpu", cores=16, environ={**inherited, "OMP_NUM_THREADS": "2"}, local_ranks=3)
    assert (user.intra_op, user.source) == (2, "OMP_NUM_THREADS")
    assert "SKYRL_TX_CHOSEN_NUM_THREADS" not in user.env  # so the processes it starts keep the user's count
    grandchild = choose_threads("cpu", cores=16, environ={**inherited, **user.env}, local_ranks=3)
    assert (grandchild.intra_op, grandchild.source) == (2, "OMP_NUM_THREADS")


def test_every_compute_process_of_a_node_takes_one_share() -> None:
    """The engine counts its node's compute processes (trainer ranks, sampler engine ranks) and records the count;
    a rank or sampler engine it starts inherits it and takes the same share, not its parent's whole count."""
    from skyrl_tx.parallel.layout import engine_node_processes

    settings = BackendSettings.from_dict({"fully_sharded_data_parallel_size": 2, "colocate_all": False,
                                          "num_inference_engines": 2, "inference_engine_tensor_parallel_size": 2})
    assert engine_node_processes(settings) == 2 + 2 * 2
    assert engine_node_processes(BackendSettings(num_inference_engines=2)) == 1  # colocated: sampling in the engine
    engine = choose_threads("cpu", cores=25, environ={}, local_ranks=engine_node_processes(settings))
    child = choose_threads("cpu", cores=25, environ={**engine.env})  # what a spawned rank sees
    assert (engine.intra_op, child.intra_op, child.source) == (4, 4, "default")
    assert "split between 6 compute processes" in child.reason
    assert choose_threads("cpu", cores=25, environ={}).intra_op == 24  # a process alone on the node


def test_waiting_threads_sleep_unless_the_environment_says_otherwise() -> None:
    assert choose_threads("cpu", cores=4, environ={}).env["OMP_WAIT_POLICY"] == "PASSIVE"
    for key, value in (("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "10000"), ("KMP_BLOCKTIME", "5")):
        env = choose_threads("cpu", cores=4, environ={key: value}).env
        assert "OMP_WAIT_POLICY" not in env and "KMP_BLOCKTIME" not in env
    assert "MKL_NUM_THREADS" not in choose_threads("cpu", cores=4, environ={"MKL_NUM_THREADS": "2"}).env


def test_torch_policy_leaves_torch_defaults() -> None:
    choice = choose_threads("cpu", 4, cores=8, environ={"SKYRL_TX_THREADS": "torch", "OMP_NUM_THREADS": "2"})
    assert (choice.intra_op, choice.source, choice.env) == (None, "torch", {})


def test_num_threads_is_a_validated_backend_config_key() -> None:
    assert BackendSettings.from_json('{"num_threads": 3}').num_threads == 3
    with pytest.raises(InvalidArgumentError, match="num_threads must be >= 0"):
        BackendSettings.from_json('{"num_threads": -1}')


def start_engine(tmp_path: Path, model_dir: Path, backend: dict, env: dict[str, str]) -> str:
    """Runs `python -m skyrl_tx.engine` until it reports ready, closes its stdin (it exits) and returns its log."""
    url = f"sqlite:///{tmp_path / 'engine.db'}"
    migrate.upgrade(url)
    settings = EngineSettings(base_model="tiny-qwen3", model_dir=str(model_dir), database_url=url,
                              checkpoints_base=str(tmp_path / "checkpoints"), backend=backend)
    proc = subprocess.Popen([sys.executable, "-m", "skyrl_tx.engine", json.dumps(settings.to_json()), "--stdio"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    killer = threading.Timer(START_TIMEOUT_S, proc.kill)
    killer.start()
    try:
        first = proc.stdout.readline().strip()
        proc.stdin.close()
        log = proc.stderr.read()
        proc.wait()
    finally:
        killer.cancel()
    assert first == "ready", log[-3000:]
    return log


def threads_line(log: str) -> str:
    lines = [line for line in log.splitlines() if "threads: intra-op" in line]
    assert len(lines) == 1, log[-3000:]
    return lines[0]


@pytest.fixture()
def clean_env(preset_cache: Path) -> dict[str, str]:
    drop = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME",
            "SKYRL_TX_THREADS", "SKYRL_TX_CHOSEN_NUM_THREADS", "SKYRL_TX_NODE_COMPUTE_PROCESSES")
    return {**{k: v for k, v in os.environ.items() if k not in drop}, "SKYRL_TX_CACHE_DIR": str(preset_cache)}


def test_engine_process_applies_and_logs_its_choice(tmp_path: Path, tiny_model_dir, clean_env) -> None:
    model_dir = tiny_model_dir("tiny-qwen3")
    line = threads_line(start_engine(tmp_path / "key", model_dir, {"num_threads": 3}, clean_env))
    assert "intra-op 3, inter-op 1 (num_threads: backend config)" in line
    assert "OMP_WAIT_POLICY=PASSIVE" in line and "did not reach OpenMP" not in line  # set before torch loaded
    assert re.search(r"torch runs 3 intra-op / 1 inter-op threads", line), line

    line = threads_line(start_engine(tmp_path / "env", model_dir, {"num_threads": 3},
                                     {**clean_env, "OMP_NUM_THREADS": "2"}))
    assert "intra-op 2, inter-op 1 (OMP_NUM_THREADS: set in the environment)" in line
    assert "torch runs 2 intra-op" in line

    line = threads_line(start_engine(tmp_path / "default", model_dir, {}, clean_env))
    expected = max(1, len(os.sched_getaffinity(0)) - API_CORES)
    assert f"intra-op {expected}, inter-op 1 (default: " in line and f"torch runs {expected} intra-op" in line
