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
from skyrl_tx.ports import free_local_port


def _free_port() -> int:
    return free_local_port()  # outside the ephemeral range: skyrl_tx/ports.py says why


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
            first = int(settings.device.split(":", 1)[1]) if ":" in settings.device else 0
            raw["device"] = f"cuda:{first + rank % self.ranks_per_process}"
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
