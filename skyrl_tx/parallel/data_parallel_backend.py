"""DataParallelBackend: the engine's backend on rank 0 of a data- and tensor-parallel group, mirroring every state
change to the local worker ranks it starts (one process per device), which run the same calls in lock-step.

Rank 0 (the engine process) is the only rank that talks to the database; the workers only mirror calls. The
C++ core does the parallel math (backend/data_parallel.h: rows split by tokens, outputs and gradients summed;
optim/zero_adamw.h: a full fine-tune's gradients and moments sharded), so every rank holds the same weights after
every call; what only reads weights (trainable_state, token_logprobs) runs on rank 0 alone. Colocated sampling is
shared: each data-parallel replica decodes a share of the sample requests with its own KV cache, the sampler
snapshots mirrored to every rank (parallel/sampling_share.py). A call is sent to the workers over a Gloo control
group, then run:
- collective calls (forward_backward, forward, optim_step, and reading a full model's sharded optimizer state or
  gradients) run on all ranks at once (their errors are decided before any collective, the same on every rank);
- other state changes (create/remove models, set weights or optimizer state) run on rank 0 first and are mirrored
  only if they succeed, so a refused call (an unload while samples run) changes nothing anywhere.
Every mirrored call ends with each worker's outcome gathered to rank 0: ranks that disagree (a worker out of memory)
are a RanksDiverged error, and the engine restarts the whole group and recovers as after a crash.

Tensor parallelism (tensor_parallel_size T > 1), or experts spread over the data-parallel ranks: each rank holds its
part of the weights, so everything that computes with them or reads them whole is collective too (logprobs, reading
weights), and what changes the sampling state (snapshots) is mirrored. With T > 1 a replica's T ranks decode its
share together. Experts spread over the data-parallel ranks make every decode step collective over all of them, so
there every rank decodes every request (submitted samples mirrored, steps collective), as one replica.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Any

from skyrl_tx.config import BackendSettings
from skyrl_tx.errors import InternalError, InvalidArgumentError
from skyrl_tx.parallel.layout import RankLayout
from skyrl_tx.parallel.sampling_share import SAMPLING_COMMAND, ReplicaSampler, SamplingShare, StepAnswer

log = logging.getLogger("skyrl_tx.parallel")

# optim_step, optimizer_state and trainable_grads are collective for a full fine-tune, whose gradients and AdamW
# moments are ZeRO-sharded over the ranks (csrc/optim/zero_adamw.h); for a LoRA model they run everywhere alike.
COLLECTIVE_CALLS = ("forward_backward", "forward", "optim_step", "optimizer_state", "trainable_grads")
MIRRORED_CALLS = ("create_model", "create_adapter", "remove_model", "remove_adapter", "set_adapter_weights",
                  "load_peft_adapter", "set_trainable_state", "set_optimizer_state", "restore_optimizer")
# With tensor parallelism: calls that compute with the sharded weights or gather them, and sampling state changes.
# join_weight_sync and receive_weights: a tensor-parallel sampler engine's ranks each join the trainer's sync group.
TENSOR_PARALLEL_COLLECTIVE_CALLS = ("trainable_state", "adapter_state_dict", "frozen_model_weights", "sample_step",
                                    "sample", "token_logprobs", "join_weight_sync", "receive_weights")
TENSOR_PARALLEL_MIRRORED_CALLS = ("snapshot", "load_snapshot", "load_frozen_model", "remove_snapshot",
                                  "submit_sample")
# Shared sampling (data-parallel replicas that each decode a share): every replica samples every snapshot.
SHARED_SAMPLING_MIRRORED_CALLS = ("snapshot", "load_snapshot", "load_frozen_model", "remove_snapshot")
COLLECTIVE_TIMEOUT_S = 600.0  # a rank waiting this long inside a step for the others: a dead or hung rank
IDLE_FOREVER = datetime.timedelta(days=365)  # the control group: workers wait for the next call however long


GROUP_BROKEN_EXIT = 75  # the engine process's exit code when its group broke (the supervisor restarts it)


def _group_broken(exc: BaseException) -> bool:
    """A failed collective (csrc/dist/collectives.cpp names it), ranks that diverged, or a failed control message."""
    if isinstance(exc, RanksDiverged):
        return True
    if isinstance(exc, InternalError) and getattr(exc, "message", str(exc)).startswith("collective "):
        return True
    return isinstance(exc, (RuntimeError, ConnectionError)) and not isinstance(exc, InternalError) and (
        "gloo" in str(exc).lower() or "connection" in str(exc).lower())


class RanksDiverged(InternalError):
    """A mirrored call ended differently on some rank: the group's state can no longer be trusted."""


def _outcome(exc: BaseException | None) -> str:
    return "ok" if exc is None else f"{type(exc).__name__}: {exc}"


def _join_rank(model_dir: str, settings: dict[str, Any], layout: RankLayout, rank: int) -> _Channel:
    """Every rank, in the same order: joins the group and makes its subgroups and the control group, then loads its
    part of the model (its tensor-parallel shard, read from the checkpoint directory itself) and attaches its
    data-parallel group."""
    import torch.distributed as td

    from skyrl_tx.backend.native import NativeBackend
    from skyrl_tx.parallel.group import RankAddress, join_group, join_subgroups

    # The rank's own device (rank_settings: cuda:first + local rank): NCCL there, Gloo on CPU (collective_backend_for).
    join_group(RankAddress(layout.coordinator_address, rank, layout.world), device=settings["device"],
               timeout_s=COLLECTIVE_TIMEOUT_S)
    tensor_parallel, data_parallel = join_subgroups(rank, layout.tensor_parallel_groups(),
                                                    layout.data_parallel_groups(), timeout_s=COLLECTIVE_TIMEOUT_S)
    control = td.new_group(backend="gloo", timeout=IDLE_FOREVER)
    backend_settings = BackendSettings.from_dict(settings)
    # Experts over the data-parallel ranks: the model is built with its share of the experts only.
    backend = NativeBackend(Path(model_dir), backend_settings, tensor_parallel=tensor_parallel,
                            expert_parallel=data_parallel if backend_settings.experts_over_data_parallel else None)
    if data_parallel is not None:
        backend.attach_collectives(data_parallel)
    return _Channel(backend, control, replica=rank // layout.tensor_parallel)


def _worker_main(model_dir: str, settings: dict[str, Any], rank: int, world: int, address: str) -> None:
    """A worker rank: joins the group, loads its part of the model, then runs what rank 0 sends until told to stop."""
    from skyrl_tx.parallel.child_start import start_child_process

    start_child_process(f"rank {rank}", settings)  # first: before torch loads
    layout = RankLayout(world, 1, address, int(settings.get("tensor_parallel_size", 1)))
    try:
        channel = _join_rank(model_dir, settings, layout, rank)
    except InvalidArgumentError as exc:  # a configuration that cannot work: do not rejoin (exit code 2)
        log.error("rank %d: %s", rank, exc.message)
        _end_rank(2)
    channel.serve()
    _end_rank(0)


def _end_rank(code: int) -> None:
    """Ends a rank that joined a group without running interpreter teardown: Gloo's threads are still up then, and
    tearing the group down at exit sometimes aborts ("terminate called without an active exception", exit code -6),
    which `skyrl-tx worker` would read as a crash and rejoin instead of reporting the configuration error."""
    logging.shutdown()  # flushes the handlers
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class _Channel:
    """The control plane: commands from rank 0 and outcomes back, as Python objects on a Gloo group (the data
    plane, the groups the core's collectives use, is NCCL on GPUs)."""

    def __init__(self, backend: Any, control: Any, replica: int = 0):
        import torch.distributed as td

        self.backend, self.td, self.control = backend, td, control
        self.sampler = ReplicaSampler(backend, replica)  # this rank's share of sampling (parallel/sampling_share.py)
        self._check_same_everywhere()

    def _check_same_everywhere(self) -> None:
        """Every rank must serve the same model with the same build and layout (a node with another checkpoint or
        version would silently train something else): compared at join, named on every rank."""
        import torch

        mine = {"model": dataclasses.asdict(self.backend.decoder_config), "torch": torch.__version__,
                "world": self.td.get_world_size()}
        everyone: list[Any] = [None] * self.td.get_world_size()
        self.td.all_gather_object(everyone, mine, group=self.control)
        for rank, theirs in enumerate(everyone):
            differs = sorted(k for k in mine if theirs.get(k) != everyone[0].get(k))
            if differs:
                raise InvalidArgumentError(f"data parallel: rank {rank} differs from rank 0 in {', '.join(differs)} "
                                           f"(rank 0: {[everyone[0][k] for k in differs]}, rank {rank}: "
                                           f"{[theirs[k] for k in differs]}); start every node with the same "
                                           "--base-model and skyrl_tx/torch versions")

    def send(self, command: Any) -> None:
        self.td.broadcast_object_list([command], src=0, group=self.control)

    def receive(self) -> Any:
        box = [None]
        self.td.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def gather_outcomes(self, mine: str) -> list[str]:
        outcomes = [None] * self.td.get_world_size()
        self.td.all_gather_object(outcomes, mine, group=self.control)
        return outcomes

    def gather_answers(self, mine: StepAnswer) -> list[StepAnswer]:
        answers: list[Any] = [None] * self.td.get_world_size()
        self.td.all_gather_object(answers, mine, group=self.control)
        return answers

    def serve(self) -> None:
        while (command := self.receive()) is not None:
            method, args, kwargs = command
            if method == SAMPLING_COMMAND:  # its errors are in the answer
                self.gather_answers(self.sampler.step(*args, **kwargs))
                continue
            error = None
            try:
                getattr(self.backend, method)(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - reported to rank 0, which decides
                error = exc
            self.gather_outcomes(_outcome(error))
        log.info("rank %d stops: it decoded %d sampled sequences (replica %d's share)", self.td.get_rank(),
                 self.sampler.decoded, self.sampler.replica)


class DataParallelBackend:
    """Rank 0's backend (a NativeBackend plus the workers). Same interface as NativeBackend."""

    def __init__(self, local: Any, channel: _Channel, workers: list[Any], sharded: bool = False,
                 replicas: int = 1, tensor_parallel: int = 1, share_sampling: bool = False):
        """sharded: no rank holds the whole model (tensor parallelism, or experts spread over the data-parallel
        ranks), so reading weights runs on every rank. share_sampling: each of the `replicas` data-parallel replicas
        (of `tensor_parallel` ranks) decodes a share of the sample requests; else every rank decodes every request
        when sharded, rank 0 alone when not."""
        self._local, self._channel, self._workers = local, channel, workers
        self._collective = COLLECTIVE_CALLS + (TENSOR_PARALLEL_COLLECTIVE_CALLS if sharded else ())
        self._mirrored_calls = MIRRORED_CALLS + (TENSOR_PARALLEL_MIRRORED_CALLS if sharded else ())
        self._replicas, self._tp = replicas, tensor_parallel
        self._share: SamplingShare | None = None
        if share_sampling:
            self._collective = tuple(c for c in self._collective if c != "sample_step")
            self._mirrored_calls = tuple(c for c in self._mirrored_calls if c != "submit_sample") + tuple(
                c for c in SHARED_SAMPLING_MIRRORED_CALLS if c not in self._mirrored_calls)
            self._share = SamplingShare(channel.sampler, replicas, tensor_parallel, int(local.settings.seed),
                                        self._exchange_step)

    @classmethod
    def start(cls, model_dir: Path, settings: BackendSettings) -> DataParallelBackend:
        """Starts this node's other ranks (spawn), joins the group with them (remote nodes' ranks join through
        `skyrl-tx worker`), loads rank 0's part of the model, and checks every rank serves the same model with the
        same build."""
        import torch.distributed as td

        layout = RankLayout.from_settings(settings)
        workers = layout.spawn(str(model_dir), settings, layout.ranks_of(0)[1:], _worker_main)
        channel = _join_rank(str(model_dir), layout.rank_settings(settings, 0), layout, 0)
        log.info("parallel: %d ranks (%d data-parallel x %d tensor-parallel) over %d node process(es) at %s (rank 0 "
                 "pid %d, local workers %s); collectives on %s", layout.world, layout.data_parallel,
                 layout.tensor_parallel, layout.processes, layout.coordinator_address, os.getpid(),
                 [w.pid for w in workers], td.get_backend())
        # Sampler engines (colocate_all false) sample snapshots elsewhere: the trainer's ranks keep no copies then.
        share = layout.data_parallel > 1 and not settings.experts_over_data_parallel and settings.colocate_all
        return cls(channel.backend, channel, workers,
                   sharded=layout.tensor_parallel > 1 or settings.experts_over_data_parallel,
                   replicas=layout.data_parallel, tensor_parallel=layout.tensor_parallel, share_sampling=share)

    def _mirrored(self, method: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._run_everywhere(method, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - a broken group is a crash; anything else is the call's error
            if _group_broken(exc) or any(not w.is_alive() for w in self._workers):
                self._crash(method, exc)
            raise

    def _run_everywhere(self, method: str, *args: Any, **kwargs: Any) -> Any:
        error, result = None, None
        collective = method in self._collective
        if collective:
            self._channel.send((method, args, kwargs))
        try:
            result = getattr(self._local, method)(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001
            error = exc
        if not collective:
            if error is not None:  # refused here: nothing changed, nothing to mirror
                raise error
            self._channel.send((method, args, kwargs))
        outcomes = self._channel.gather_outcomes(_outcome(error))
        if len(set(outcomes)) != 1:
            raise RanksDiverged(f"{method} ended differently on the parallel ranks: "
                                + "; ".join(f"rank {r}: {o[:300]}" for r, o in enumerate(outcomes)))
        if error is not None:
            raise error
        return result

    def _crash(self, method: str, exc: BaseException) -> None:
        """A rank died, hung or diverged: the group's state can no longer be trusted. The engine process ends here
        (its workers die with it) before the request that was running is stored, so the supervisor restarts the whole
        group and recovery runs that request again on rebuilt ranks, as after any engine crash (no request lost or
        applied twice)."""
        log.critical("data parallel: %s broke the group (%s: %s); the engine restarts with all its ranks", method,
                     type(exc).__name__, exc)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(GROUP_BROKEN_EXIT)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # not set yet (construction, copying): never a backend call
            raise AttributeError(name)
        if name in self._collective or name in self._mirrored_calls:
            return lambda *args, **kwargs: self._mirrored(name, *args, **kwargs)
        return getattr(self._local, name)  # reads (and sampling, unless shared or sharded): rank 0 alone

    # ---- sampling: shared by the replicas (parallel/sampling_share.py), else as __getattr__ routes it --------
    def submit_sample(self, request: Any) -> int:
        if self._share is None:
            return self.__getattr__("submit_sample")(request)
        return self._share.submit(request)

    def sample_step(self) -> list[tuple[int, Any]]:
        if self._share is None:
            return self.__getattr__("sample_step")()
        try:
            return self._share.step()
        except Exception as exc:  # noqa: BLE001 - a rank's step broke the group: a crash, as for any call
            if _group_broken(exc) or any(not w.is_alive() for w in self._workers):
                self._crash("sample_step", exc)
            raise

    def sample_progress(self, sample_ids: Any) -> dict[int, list[list[int]]]:
        if self._share is None:
            return self._local.sample_progress(sample_ids)
        return self._share.progress(sample_ids)

    def sampling_idle(self) -> bool:
        return self._local.sampling_idle() if self._share is None else self._share.idle()

    def remove_model(self, model_id: str) -> None:
        if self._share is not None:
            self._share.check_unused(model_id, f"unload_model: model '{model_id}' is serving running sample "
                                               "requests; unload it once they finish")
        self._mirrored("remove_model", model_id)

    def remove_adapter(self, adapter_id: str) -> None:
        if self._share is not None:
            self._share.check_unused(adapter_id, f"unload_model: model '{adapter_id}' is serving running sample "
                                                 "requests; unload it once they finish")
        self._mirrored("remove_adapter", adapter_id)

    def remove_snapshot(self, snapshot_id: str) -> None:
        if self._share is not None:
            self._share.check_unused(snapshot_id, f"snapshot '{snapshot_id}' is serving running sample requests; "
                                                  "remove it once they finish")
        self.__getattr__("remove_snapshot")(snapshot_id)

    def _exchange_step(self, submissions: list[list[tuple[int, Any]]]) -> list[StepAnswer]:
        """One decode step on every rank at once (each its replica's requests, after submitting the new ones); every
        rank's answer gathered here. Returns each replica's answer, which its tensor-parallel ranks must agree on."""
        self._channel.send((SAMPLING_COMMAND, (submissions,), {}))
        answers = self._channel.gather_answers(self._channel.sampler.step(submissions))
        for replica in range(self._replicas):
            first = replica * self._tp
            for rank in range(first + 1, first + self._tp):
                if answers[rank].signature() != answers[first].signature():
                    raise RanksDiverged(f"a sample step ended differently within replica {replica}: rank {first} "
                                        f"{answers[first].signature()}, rank {rank} {answers[rank].signature()}")
        return [answers[replica * self._tp] for replica in range(self._replicas)]

    def close(self) -> None:
        """Stops the workers (they exit when told, or with the group when this process dies)."""
        if self._share is not None:
            log.info("data parallel sampling: sequences decoded per replica %s", self._share.decoded)
        try:
            self._channel.send(None)
        except Exception:  # noqa: BLE001 - a worker already gone
            log.warning("data parallel: stopping the workers failed:\n%s", traceback.format_exc())
        for w in self._workers:
            w.join(10)
            if w.is_alive():
                w.kill()


def run_node_process(model_dir: Path, settings: BackendSettings, process_id: int) -> int:
    """`skyrl-tx worker`: runs node process `process_id`'s ranks and starts them again whenever they exit (the
    engine restarted, or its node went away: the ranks fail their next call and rejoin the next group). Returns 2
    on a configuration error (the ranks report it), else runs until interrupted."""
    import time

    from skyrl_tx.engine.threads import share_node_cores

    layout = RankLayout.from_settings(settings)
    ranks = layout.ranks_of(process_id)
    if process_id == 0:
        raise InvalidArgumentError("process id 0 is the engine's node: start the server there, workers elsewhere")
    share_node_cores(len(ranks))  # this node's ranks split its cores (this process only supervises them)
    while True:
        procs = layout.spawn(str(model_dir), settings, ranks, _worker_main)
        log.info("node process %d: ranks %s joining %s (pids %s)", process_id, list(ranks),
                 layout.coordinator_address, [p.pid for p in procs])
        for p in procs:
            p.join()
        if any(p.exitcode == 2 for p in procs):
            return 2
        log.warning("node process %d: ranks exited (%s); rejoining in 2 s", process_id, [p.exitcode for p in procs])
        time.sleep(2.0)
