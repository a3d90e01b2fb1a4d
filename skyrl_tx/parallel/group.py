"""join_group: a rank joins the engine's c10d process group and gets the C++ collectives on it.

Rendezvous is c10d's TCPStore at the coordinator address (rank 0 hosts it, as torchrun's MASTER_ADDR/MASTER_PORT
would); the group's backend comes from collective_backend_for(the rank's device): Gloo on CPU; NCCL on CUDA, with
Gloo registered beside it for the host tensors a step reduces. Made by torch.distributed; every collective of a step
is issued from C++ (skyrl_tx._C.Collectives, csrc/dist/collectives.h says why).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

from skyrl_tx._ext import load_extension
from skyrl_tx.errors import InternalError, InvalidArgumentError


def collective_backend_for(device: str) -> str:
    """The c10d backend a rank whose tensors sit on `device` runs its collectives on: "nccl" on a CUDA device
    ("cuda", "cuda:N"), else "gloo". The one place this is decided (join_group, join_side_group,
    layout.weight_sync_on_cuda)."""
    return "nccl" if device.split(":", 1)[0] == "cuda" else "gloo"


def init_backend_for(device: str) -> str:
    """init_process_group's backend for a rank on `device`. On CUDA, Gloo stays registered for CPU tensors beside
    NCCL (torch dispatches each collective by its tensor's device): a few small reductions of a step are host
    tensors (AdamW's tensor-parallel norm parts, csrc/optim/adamw.cpp), which NCCL refuses. Subgroups made later
    with new_group inherit both."""
    return "cpu:gloo,cuda:nccl" if collective_backend_for(device) == "nccl" else "gloo"


@dataclass(frozen=True)
class RankAddress:
    """Where a rank joins and who it is: `coordinator_address` is HOST:PORT of rank 0's store."""

    coordinator_address: str
    rank: int
    world_size: int

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> RankAddress:
        """torchrun / SLURM-style variables: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE."""
        env = os.environ if environ is None else environ
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if k not in env]
        if missing:
            raise InvalidArgumentError(f"rank address: {', '.join(missing)} not set in the environment")
        return cls(f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}", int(env["RANK"]), int(env["WORLD_SIZE"]))

    def host_port(self) -> tuple[str, int]:
        host, sep, port = self.coordinator_address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidArgumentError(f"coordinator_address {self.coordinator_address!r} is not HOST:PORT "
                                       "(e.g. 10.0.0.1:29500)")
        return host, int(port)

    def check(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise InvalidArgumentError(f"rank {self.rank} is not in [0, {self.world_size}): set process_id / RANK "
                                       "below num_processes / WORLD_SIZE")


def join_group(address: RankAddress, *, device: str, timeout_s: float = 60.0) -> Any:
    """Joins (rank 0 also hosts the store) and returns skyrl_tx._C.Collectives. `device` is this rank's own (no
    default: a rank on cuda:N that said nothing would join a Gloo group and copy every collective through the host);
    collective_backend_for picks the backend. Ranks that do not all join within `timeout_s` fail every rank with an
    error that names the coordinator, the world size and this rank."""
    address.check()
    host, port = address.host_port()
    native = load_extension()  # torch first, then _C
    import torch
    import torch.distributed as td

    timeout = datetime.timedelta(seconds=timeout_s)
    backend = init_backend_for(device)
    if collective_backend_for(device) == "nccl":
        if not td.is_nccl_available():
            raise InvalidArgumentError(f"rank {address.rank} on {device} needs NCCL, which this torch build lacks")
        if torch.device(device).index is not None:  # NCCL's communicators (and barrier) use the current device
            torch.cuda.set_device(torch.device(device))
    try:
        store = td.TCPStore(host, port, address.world_size, is_master=address.rank == 0, timeout=timeout,
                            wait_for_workers=True)
        if td.is_initialized():
            raise InvalidArgumentError("join_group: this process already belongs to a process group")
        td.init_process_group(backend, store=store, rank=address.rank, world_size=address.world_size,
                              timeout=timeout)
    except InvalidArgumentError:
        raise
    except Exception as exc:  # noqa: BLE001 - torch raises several kinds (DistStoreError, RuntimeError, timeouts)
        raise InternalError(f"rank {address.rank} of {address.world_size} could not join the group at "
                            f"{address.coordinator_address} within {timeout_s:g} s (a rank missing or slow to "
                            f"start, or the address unreachable): {exc}") from exc
    return native.Collectives(td.distributed_c10d._get_default_group())


def join_subgroups(rank: int, tensor_parallel_groups: list[list[int]], data_parallel_groups: list[list[int]],
                   timeout_s: float = 60.0) -> tuple[Any, Any]:
    """After join_group: this rank's tensor-parallel and data-parallel groups as skyrl_tx._C.Collectives (None for
    a group of one rank). Every rank makes every group, in the same order (torch.distributed.new_group's rule);
    a group of every rank is the default group itself."""
    native = load_extension()
    import torch.distributed as td

    world = td.get_world_size()
    mine: list[Any] = []
    for groups in (tensor_parallel_groups, data_parallel_groups):
        own = None
        for ranks in groups:
            if len(ranks) == 1:
                continue
            if len(ranks) == world:
                group = td.distributed_c10d._get_default_group()
            else:
                group = td.new_group(ranks=ranks, timeout=datetime.timedelta(seconds=timeout_s))
            if rank in ranks:
                own = native.Collectives(group)
        mine.append(own)
    return mine[0], mine[1]


def join_side_group(address: RankAddress, device: str = "cpu", timeout_s: float = 60.0) -> Any:
    """A group of its own beside the process's default group (a trainer and its sampler engines: the trainer may also
    be rank 0 of a data-parallel default group), for tensors on `device`: NCCL when every rank passes a CUDA device
    (each its own), else Gloo. Rendezvous through its own TCPStore at `address` (rank 0 hosts it); returns
    skyrl_tx._C.Collectives on it. Built as torch.distributed builds its groups internally (a c10d ProcessGroup with
    registered backends), because init_process_group makes only the default group and new_group needs every rank
    of it. On a CUDA group Gloo stays registered for CPU tensors, so a stray CPU tensor is still sent, just slower."""
    address.check()
    host, port = address.host_port()
    native = load_extension()
    import torch
    import torch.distributed as td
    from torch._C._distributed_c10d import ProcessGroup

    timeout = datetime.timedelta(seconds=timeout_s)
    on_cuda = collective_backend_for(device) == "nccl"
    if on_cuda and not td.is_nccl_available():
        raise InvalidArgumentError(f"the weight-sync group on {device} needs NCCL, which this torch build lacks")
    try:
        store = td.TCPStore(host, port, address.world_size, is_master=address.rank == 0, timeout=timeout,
                            wait_for_workers=True)
        group = ProcessGroup(store, address.rank, address.world_size)
        gloo = td.ProcessGroupGloo(td.PrefixStore("side/", store), address.rank, address.world_size, timeout)
        group._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, gloo)
        group._set_default_backend(ProcessGroup.BackendType.GLOO)
        if on_cuda:
            if torch.device(device).index is not None:  # NCCL's communicator binds to the current device
                torch.cuda.set_device(torch.device(device))
            options = td.ProcessGroupNCCL.Options()
            options.is_high_priority_stream = False
            options._timeout = timeout
            nccl = td.ProcessGroupNCCL(td.PrefixStore("side-nccl/", store), address.rank, address.world_size, options)
            group._register_backend(torch.device("cuda"), ProcessGroup.BackendType.NCCL, nccl)
            group._set_default_backend(ProcessGroup.BackendType.NCCL)
    except Exception as exc:  # noqa: BLE001 - torch raises several kinds (DistStoreError, RuntimeError, timeouts)
        raise InternalError(f"rank {address.rank} of {address.world_size} could not join the side group at "
                            f"{address.coordinator_address} ({'NCCL' if on_cuda else 'Gloo'}) within {timeout_s:g} s: "
                            f"{exc}") from exc
    return native.Collectives(group)


def leave_group() -> None:
    import torch.distributed as td

    if td.is_initialized():
        td.destroy_process_group()
