"""RankLayout: which ranks run where — `fully_sharded_data_parallel_size` data-parallel replicas of
`tensor_parallel_size` ranks each, spread evenly over `num_processes` node processes (the seed README's vocabulary:
process 0 is the engine's node, the others run `skyrl-tx worker --process-id I`), one rank per device — and the
local rank processes a node process starts. Rank r is tensor-parallel rank r % T of replica r // T: a replica's ranks
are neighbours, so they share a node (and its fast links) whenever T divides the ranks per node."""

from __future__ import annotations

import dataclasses
import multiprocessing
from dataclasses import dataclass
from typing import Any

from skyrl_tx.config import BackendSettings
from skyrl_tx.errors import InvalidArgumentError
from skyrl_tx.parallel.group import collective_backend_for
from skyrl_tx.ports import free_local_port


def _free_port() -> int:
    return free_local_port()  # outside the ephemeral range: skyrl_tx/ports.py says why


# A node process's place from a launcher's environment, first match wins: torchrun (one process per node:
# --nproc-per-node 1, this process starting the node's ranks itself), SLURM, or plain NODE_RANK / NNODES.
_NODE_ID_VARIABLES = ("GROUP_RANK", "SLURM_NODEID", "NODE_RANK")
_NODE_COUNT_VARIABLES = ("SLURM_NNODES", "NNODES")


def first_cuda_index(device: str) -> int:
    """N of "cuda:N", 0 of "cuda": where a node's devices for these ranks begin."""
    return int(device.split(":", 1)[1]) if ":" in device else 0


def node_process_from_env(environ: dict[str, str], coordinator_address: str | None = None,
                          num_processes: int | None = None, process_id: int | None = None) -> tuple[str, int, int]:
    """(coordinator_address, num_processes, process_id) of `skyrl-tx worker`: the flags given, else the launcher's
    variables (MASTER_ADDR / MASTER_PORT; GROUP_RANK, SLURM_NODEID or NODE_RANK; SLURM_NNODES, NNODES, or torchrun's
    WORLD_SIZE / LOCAL_WORLD_SIZE). InvalidArgumentError names what is missing."""
    if coordinator_address is None and "MASTER_ADDR" in environ and "MASTER_PORT" in environ:
        coordinator_address = f"{environ['MASTER_ADDR']}:{environ['MASTER_PORT']}"
    if process_id is None:
        process_id = next((int(environ[k]) for k in _NODE_ID_VARIABLES if k in environ), None)
    if num_processes is None:
        num_processes = next((int(environ[k]) for k in _NODE_COUNT_VARIABLES if k in environ), None)
        if num_processes is None and "WORLD_SIZE" in environ and "LOCAL_WORLD_SIZE" in environ:
            num_processes = int(environ["WORLD_SIZE"]) // int(environ["LOCAL_WORLD_SIZE"])
    missing = [what for what, value in (("--coordinator-address (or MASTER_ADDR and MASTER_PORT)", coordinator_address),
                                        ("--num-processes (or SLURM_NNODES, NNODES, torchrun's WORLD_SIZE and "
                                         "LOCAL_WORLD_SIZE)", num_processes),
                                        ("--process-id (or GROUP_RANK, SLURM_NODEID, NODE_RANK)", process_id))
               if value is None]
    if missing:
        raise InvalidArgumentError(f"skyrl-tx worker: set {'; '.join(missing)}")
    return coordinator_address, num_processes, process_id


@dataclass(frozen=True)
class RankLayout:
    world: int  # ranks in all
    processes: int  # node processes (the engine's is process 0)
    coordinator_address: str  # HOST:PORT of rank 0's TCPStore
    tensor_parallel: int = 1  # ranks per data-parallel replica

    @classmethod
    def from_settings(cls, settings: BackendSettings) -> RankLayout:
        tp = settings.tensor_parallel_size
        world, processes = settings.fully_sharded_data_parallel_size * tp, max(settings.num_processes, 1)
        if world % processes:
            raise InvalidArgumentError(
                f"--backend-config: fully_sharded_data_parallel_size x tensor_parallel_size = {world} ranks is not a "
                f"multiple of num_processes {processes}: every node process runs the same number of ranks (one per "
                "device)")
        if processes > 1 and not settings.coordinator_address:
            raise InvalidArgumentError("--backend-config: num_processes > 1 needs coordinator_address (HOST:PORT "
                                       "where the engine's node listens and the other nodes' workers join)")
        return cls(world, processes, settings.coordinator_address or f"127.0.0.1:{_free_port()}", tp)

    @property
    def data_parallel(self) -> int:
        return self.world // self.tensor_parallel

    def tensor_parallel_groups(self) -> list[list[int]]:
        """The ranks of each replica: [[0, .., T-1], [T, .., 2T-1], ...]."""
        t = self.tensor_parallel
        return [list(range(d * t, (d + 1) * t)) for d in range(self.data_parallel)]

    def data_parallel_groups(self) -> list[list[int]]:
        """The ranks holding the same shard in every replica: [[0, T, 2T, ..], [1, T+1, ..], ...]."""
        return [list(range(t, self.world, self.tensor_parallel)) for t in range(self.tensor_parallel)]

    @property
    def ranks_per_process(self) -> int:
        return self.world // self.processes

    def ranks_of(self, process_id: int) -> range:
        if not 0 <= process_id < self.processes:
            raise InvalidArgumentError(f"process id {process_id} is not in [0, {self.processes}): set --process-id "
                                       "below --num-processes")
        return range(process_id * self.ranks_per_process, (process_id + 1) * self.ranks_per_process)

    def rank_settings(self, settings: BackendSettings, rank: int) -> dict[str, Any]:
        """The settings rank `rank` builds its part with: on a GPU node, device first + rank % per-node, where
        `device` "cuda:first" names the node's first device for these ranks ("cuda": 0)."""
        raw = dataclasses.asdict(settings)
        if settings.device.startswith("cuda"):
            raw["device"] = f"cuda:{first_cuda_index(settings.device) + rank % self.ranks_per_process}"
        return raw

    def spawn(self, model_dir: str, settings: BackendSettings, ranks: range | list[int], target: Any) -> list[Any]:
        """Starts `target(model_dir, settings_dict, rank, world, address)` for each rank, in its own process."""
        context = multiprocessing.get_context("spawn")
        procs = [context.Process(target=target, args=(model_dir, self.rank_settings(settings, rank), rank,
                                                      self.world, self.coordinator_address),
                                 name=f"skyrl_tx-rank{rank}", daemon=True) for rank in ranks]
        for p in procs:
            p.start()
        return procs


def sampler_device(settings: BackendSettings, index: int) -> str:
    """Sampler engine `index`'s (first) device: on a GPU node the devices after the trainer's ranks (with 2 trainer
    ranks on cuda:0 and cuda:1, the sampler engines use cuda:2, cuda:3, ...; engines of T tensor-parallel ranks
    each take T devices in a row: cuda:2-3, cuda:4-5, ...), or where inference_engine_devices puts it."""
    if settings.inference_engine_devices:
        return settings.inference_engine_devices[index]
    if settings.device == "cpu":
        return "cpu"
    first = first_cuda_index(settings.device)
    trainer_ranks = settings.fully_sharded_data_parallel_size * settings.tensor_parallel_size
    trainer_ranks_here = trainer_ranks // max(settings.num_processes, 1)
    return f"cuda:{first + trainer_ranks_here + index * settings.inference_engine_tensor_parallel_size}"


def trainer_ranks_on_node(settings: BackendSettings) -> int:
    """The trainer ranks of one node (the engine's included): the layout's ranks spread evenly over its nodes."""
    ranks = settings.fully_sharded_data_parallel_size * settings.tensor_parallel_size
    return max(1, ranks // max(settings.num_processes, 1))


def engine_node_processes(settings: BackendSettings) -> int:
    """The processes on the engine's node that compute, each with its share of the node's cores (engine/threads.py):
    its trainer ranks (the engine process is rank 0) and, with colocate_all false, every sampler engine rank (they
    all run on the engine's node)."""
    samplers = 0 if settings.colocate_all else (settings.num_inference_engines
                                                * settings.inference_engine_tensor_parallel_size)
    return trainer_ranks_on_node(settings) + samplers


def weight_sync_on_cuda(settings: BackendSettings) -> bool:
    """Whether the trainer → sampler-engine sync group is NCCL: the trainer on CUDA, and so every sampler engine (each
    rank on its own device: sampler_device follows the trainer's, and config refuses inference_engine_devices that
    mix CPU and CUDA). Else Gloo, carrying CPU tensors (the same code)."""
    return collective_backend_for(settings.device) == "nccl"
