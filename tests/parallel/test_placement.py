"""Where ranks go: a replica's tensor-parallel ranks are neighbours, the data-parallel groups hold the same part,
each rank gets its node's device, and sampler engines take the devices after the trainer's, T in a row each."""

from __future__ import annotations

import pytest

from skyrl_tx.config import BackendSettings
from skyrl_tx.errors import InvalidArgumentError
from skyrl_tx.parallel.layout import RankLayout, sampler_device


def test_ranks_of_a_data_by_tensor_parallel_layout() -> None:
    settings = BackendSettings(fully_sharded_data_parallel_size=2, tensor_parallel_size=4, num_processes=2,
                               coordinator_address="10.0.0.1:29500", device="cuda")
    layout = RankLayout.from_settings(settings)
    assert (layout.world, layout.data_parallel, layout.tensor_parallel) == (8, 2, 4)
    assert layout.tensor_parallel_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]  # a replica per node
    assert layout.data_parallel_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert list(layout.ranks_of(1)) == [4, 5, 6, 7]
    assert [layout.rank_settings(settings, r)["device"] for r in range(8)] == [f"cuda:{i % 4}" for i in range(8)]
    # An engine whose first device is cuda:2 (a sampler engine after a 2-rank trainer): its ranks follow it.
    engine = BackendSettings(tensor_parallel_size=2, device="cuda:2")
    engine_layout = RankLayout.from_settings(engine)
    assert [engine_layout.rank_settings(engine, r)["device"] for r in range(2)] == ["cuda:2", "cuda:3"]
    with pytest.raises(InvalidArgumentError, match="not a multiple of num_processes"):
        RankLayout.from_settings(BackendSettings(tensor_parallel_size=3, num_processes=2, coordinator_address="h:1"))


def test_sampler_engines_take_the_devices_after_the_trainers() -> None:
    def devices(**kw) -> list[str]:
        settings = BackendSettings(device="cuda", colocate_all=False, num_inference_engines=2, **kw)
        return [sampler_device(settings, i) for i in range(2)]

    assert devices() == ["cuda:1", "cuda:2"]
    assert devices(fully_sharded_data_parallel_size=2) == ["cuda:2", "cuda:3"]
    assert devices(tensor_parallel_size=2, fully_sharded_data_parallel_size=2) == ["cuda:4", "cuda:5"]
    assert devices(tensor_parallel_size=2, inference_engine_tensor_parallel_size=2) == ["cuda:2", "cuda:4"]
    assert sampler_device(BackendSettings(colocate_all=False), 0) == "cpu"


def test_the_sync_group_is_nccl_only_when_the_trainer_and_every_engine_are_on_cuda() -> None:
    from skyrl_tx.parallel.layout import weight_sync_on_cuda

    def on_cuda(**kw) -> bool:
        return weight_sync_on_cuda(BackendSettings.from_dict({"colocate_all": False, "num_inference_engines": 2,
                                                              **kw}))

    assert on_cuda(device="cuda")  # engines on cuda:1 and cuda:2
    assert on_cuda(device="cuda:0", inference_engine_devices=["cuda:5", "cuda:3"])
    assert not on_cuda()  # all on the CPU: Gloo
    assert not on_cuda(inference_engine_devices=["cpu", "cpu"])  # (config refuses a CPU/CUDA mix)


def test_a_worker_node_finds_its_place_in_a_launchers_environment() -> None:
    from skyrl_tx.parallel.layout import node_process_from_env

    torchrun = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "GROUP_RANK": "1", "WORLD_SIZE": "2",
                "LOCAL_WORLD_SIZE": "1", "RANK": "1", "LOCAL_RANK": "0"}  # torchrun --nnodes 2 --nproc-per-node 1
    assert node_process_from_env(torchrun) == ("10.0.0.1:29500", 2, 1)
    slurm = {"MASTER_ADDR": "node0", "MASTER_PORT": "7777", "SLURM_NODEID": "3", "SLURM_NNODES": "4"}
    assert node_process_from_env(slurm) == ("node0:7777", 4, 3)
    assert node_process_from_env(slurm, "h:1", 2, 1) == ("h:1", 2, 1)  # the flags win
    with pytest.raises(InvalidArgumentError, match="--process-id .*GROUP_RANK"):
        node_process_from_env({"MASTER_ADDR": "h", "MASTER_PORT": "1", "NNODES": "2"})


def test_sampler_engines_go_where_inference_engine_devices_puts_them() -> None:
    raw = {"device": "cuda:0", "tensor_parallel_size": 2, "colocate_all": False, "num_inference_engines": 2,
           "inference_engine_tensor_parallel_size": 2}
    settings = BackendSettings.from_dict({**raw, "inference_engine_devices": ["cuda:6", "cuda:3"]})
    assert [sampler_device(settings, i) for i in range(2)] == ["cuda:6", "cuda:3"]  # cuda:6-7 and cuda:3-4
    cpu = BackendSettings.from_dict({"colocate_all": False, "num_inference_engines": 2,
                                     "inference_engine_devices": ["cpu", "cpu"]})
    assert [sampler_device(cpu, i) for i in range(2)] == ["cpu", "cpu"]


@pytest.mark.parametrize(("devices", "extra", "fragment"), [
    (["cuda:1", "cuda:4"], {}, "sampler engine 0 would use cuda:1, which the trainer uses"),  # trainer: cuda:0-1
    (["cuda:2", "cuda:3"], {}, "sampler engine 1 would use cuda:3, which sampler engine 0 uses"),
    (["cuda:4"], {}, "names 1 device"),
    (["cpu", "cuda:4"], {}, "must be 'cuda:N' devices"),
    (["cuda:4", "cuda:6"], {"colocate_all": True}, "only colocate_all false starts"),
    (["cuda:4", 6], {}, "inference_engine_devices must be of type tuple"),
])
def test_engine_devices_that_cannot_work_are_refused_by_name(devices: list, extra: dict, fragment: str) -> None:
    raw = {"device": "cuda:0", "tensor_parallel_size": 2, "colocate_all": False, "num_inference_engines": 2,
           "inference_engine_tensor_parallel_size": 2, "inference_engine_devices": devices, **extra}
    with pytest.raises(InvalidArgumentError, match=fragment):
        BackendSettings.from_dict(raw)


LAYOUTS = [  # (data-parallel, tensor-parallel, expert-parallel, node processes, sampler engines' tensor-parallel)
    (2, 1, 1, 1, 1), (1, 2, 1, 1, 2), (2, 2, 1, 1, 1), (2, 2, 2, 1, 2), (4, 1, 4, 1, 1), (4, 2, 1, 2, 1),
    (2, 4, 4, 2, 4), (3, 1, 1, 3, 1)]


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:0", "cuda:2"])
@pytest.mark.parametrize(("dp", "tp", "ep", "processes", "engine_tp"), LAYOUTS)
def test_every_rank_on_a_gpu_runs_its_collectives_on_nccl(device: str, dp: int, tp: int, ep: int, processes: int,
                                                           engine_tp: int) -> None:
    """Every rank of every layout gets its own device (rank_settings: what _join_rank passes join_group), and
    collective_backend_for picks NCCL for it on a GPU, Gloo on a CPU (before, ranks on cuda:N joined Gloo groups);
    sampler engines' ranks and the trainer → sampler-engine sync group the same."""
    from skyrl_tx.parallel.group import collective_backend_for, init_backend_for
    from skyrl_tx.parallel.layout import weight_sync_on_cuda

    expected = "gloo" if device == "cpu" else "nccl"
    settings = BackendSettings.from_dict({
        "fully_sharded_data_parallel_size": dp, "tensor_parallel_size": tp, "expert_parallel_size": ep,
        "num_processes": processes, "coordinator_address": "10.0.0.1:29500" if processes > 1 else "",
        "device": device, "colocate_all": False, "num_inference_engines": 2,
        "inference_engine_tensor_parallel_size": engine_tp})
    layout = RankLayout.from_settings(settings)
    rank_devices = [layout.rank_settings(settings, rank)["device"] for rank in range(layout.world)]
    assert [collective_backend_for(d) for d in rank_devices] == [expected] * layout.world, rank_devices
    if device != "cpu":  # each of a node's ranks on a device of its own (NCCL refuses two ranks on one device)
        for process in range(processes):
            mine = [rank_devices[r] for r in layout.ranks_of(process)]
            assert len(set(mine)) == len(mine), mine
    for engine in range(2):
        engine_settings = BackendSettings(tensor_parallel_size=engine_tp, device=sampler_device(settings, engine))
        engine_layout = RankLayout.from_settings(engine_settings)
        assert {collective_backend_for(engine_layout.rank_settings(engine_settings, r)["device"])
                for r in range(engine_tp)} == {expected}
    assert weight_sync_on_cuda(settings) == (expected == "nccl")
    # On a GPU the group keeps Gloo beside NCCL, for the host tensors a step reduces.
    assert init_backend_for(rank_devices[0]) == ("gloo" if device == "cpu" else "cpu:gloo,cuda:nccl")
