"""Disaggregated placement (`colocate_all: false`): sampler engines in processes of their own, each with its own
device, copy of the base model and KV cache, kept current by weight syncs from the trainer (the engine process).

SamplerEnginesBackend wraps the engine's backend for the engine loop, as ExternalSamplingBackend does for vLLM:
training stays where it is; every sampler snapshot the trainer makes (save_weights_for_sampler, ephemeral syncs,
sampler checkpoints loaded from storage, full-model snapshots moved back from disk) is sent to every sampler engine
through WeightSync over a c10d group (csrc/dist/weight_sync.h: Gloo on CPU, NCCL on GPUs), never through the disk,
and kept there as a frozen version; each sample request of the base model or of a synced snapshot runs on the
sampler engine with the fewest requests in flight (a request's num_samples together). Anything else (sampling a
live model id) runs on the trainer, as colocated. The engine processes' side: parallel/sampler_engine_process.py.

A sampler engine that dies or hangs is replaced: the others join a new sync group with a fresh one, which receives
every live version again (LoRA factors the trainer keeps; full weights read back from the trainer's own frozen copy
of the snapshot), and the requests it had run again on the engines. A failure in the middle of a sync or a
replacement makes the engine process exit instead: the supervisor restarts it with its sampler engines, and recovery
rebuilds the snapshots and reruns the unfinished requests.

Commands and results travel over one pipe per sampler engine; the engine loop's single thread is the only caller.
The trainer may be rank 0 of a data-parallel group: the sync group is a group of its own (parallel/group.py
join_side_group). A sampler engine of T tensor-parallel ranks puts every rank in the sync group (the trainer is rank
0, engine e's ranks 1 + e*T ... e*T + T): each receives the broadcast itself and keeps its part.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import time
from pathlib import Path
from typing import Any, NoReturn

from skyrl_tx.config import BackendSettings
from skyrl_tx.errors import ConflictError, InternalError
from skyrl_tx.parallel.layout import sampler_device, weight_sync_on_cuda
from skyrl_tx.parallel.sampler_engine_process import sampler_engine_main
from skyrl_tx.parallel.weight_sync import JOIN_TIMEOUT_S, weights_digest
from skyrl_tx.types import FailedSample, SampleRequest, SampleResult

log = logging.getLogger("skyrl_tx.parallel")

WAIT_S = 0.02  # sample_step waits this long for a remote result when nothing else is running
GROUP_BROKEN_EXIT = 75  # the engine process's exit code when it restarts with its sampler engines (the supervisor)



class _EngineLost(Exception):
    """A sampler engine stopped answering in the middle of a sync or a replacement."""


class SamplerEnginesBackend:
    """The engine's backend with sampling on sampler engine processes (see the module docstring). Every attribute
    not defined here is the wrapped backend's own; only the engine thread calls it."""

    def __init__(self, backend: Any, model_dir: Path, settings: BackendSettings):
        self._backend, self._model_dir, self._settings = backend, model_dir, settings
        count = settings.num_inference_engines
        self._timeout_s = settings.inference_engine_timeout_s
        self._digests = settings.weight_sync_digests
        self._heard = [time.monotonic()] * count  # when each engine last sent anything
        self._conns: list[Any] = [None] * count
        self._procs: list[Any] = [None] * count
        self._sync: Any = None
        # NCCL when the trainer and every engine are on CUDA devices: the trainer sends from its own device
        self._sync_on_cuda = weight_sync_on_cuda(settings)
        self._sync_device = settings.device if self._sync_on_cuda else "cpu"
        self._lora: dict[str, dict[str, Any] | None] = {}  # live model id → its LoRA shape (None: full weights)
        self._synced: set[str] = set()  # snapshot ids every sampler engine holds
        self._kept: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}  # LoRA versions: factors, shape
        self._ids = itertools.count(-1, -1)  # the samplers' request ids: negative, apart from the trainer's own
        self._in_flight: dict[int, tuple[int, str]] = {}  # id → (sampler engine, weights id)
        self._requests: dict[int, SampleRequest] = {}  # id → the request, to run again if its engine is lost
        self._failed: dict[int, str] = {}  # engines lost since the last replacement → why
        self._local: set[int] = set()  # ids of requests running on the trainer (live model ids)
        self._served = [0] * count  # requests sent to each sampler engine
        self._versions = 0  # syncs so far
        self._home: dict[str, int] = {}  # weights id → the engine that served it last
        self._turn = 0  # where the next tie-break among equally busy engines starts
        self._progress: dict[int, list[list[int]]] = {}
        self._finished: list[tuple[int, SampleResult]] = []
        try:
            self._regroup(list(range(count)))
        except _EngineLost as exc:
            raise InternalError(f"sampler engines did not start: {exc}") from exc
        kv_cache = (f"the rows that fit in gpu_memory_utilization={settings.gpu_memory_utilization}"
                    if settings.gpu_memory_utilization else f"{settings.max_sampling_sequences} rows")
        log.info("sampling on %d sampler engine(s) of %d tensor-parallel rank(s) each (pids %s, first devices %s), "
                 "each with a KV cache of %s of %d tokens; weights synced over c10d", count,
                 settings.inference_engine_tensor_parallel_size, [p.pid for p in self._procs],
                 [sampler_device(settings, i) for i in range(count)], kv_cache, settings.max_sampling_length)

    def __getattr__(self, name: str) -> Any:  # only for what is not defined here
        return getattr(self._backend, name)

    # ---- weights the samplers hold ------------------------------------------------------------------
    def create_model(self, model_id: str, *, lora_rank: int, alpha: float | None = None, **kwargs: Any) -> Any:
        # alpha None is the rank, as NativeBackend.create_adapter has it
        result = self._backend.create_model(model_id, lora_rank=lora_rank, alpha=alpha, **kwargs)
        self._lora[model_id] = None if lora_rank == 0 else {
            "rank": lora_rank, "alpha": float(alpha if alpha is not None else lora_rank),
            **{k: kwargs.get(k, True) for k in ("train_attn", "train_mlp", "train_unembed")}}
        return result

    def snapshot(self, model_id: str, snapshot_id: str) -> None:
        if model_id not in self._lora:  # every model the engine trains is made through create_model above
            raise InternalError(f"snapshot of {model_id!r}: the sampler engines' wrapper did not see it created")
        self._backend.snapshot(model_id, snapshot_id)
        lora = self._lora[model_id]
        tensors = (self._backend.adapter_state_dict(model_id) if lora is not None
                   else self._backend.trainable_state(model_id))
        self._sync_or_undo(snapshot_id, tensors, lora)

    def load_snapshot(self, snapshot_id: str, weights: dict[str, Any], *, rank: int, alpha: float,
                      **kwargs: Any) -> None:
        self._backend.load_snapshot(snapshot_id, weights, rank=rank, alpha=alpha, **kwargs)
        self._sync_or_undo(snapshot_id, weights, {"rank": rank, "alpha": float(alpha), **kwargs})

    def load_frozen_model(self, snapshot_id: str, weights: dict[str, Any]) -> None:
        self._backend.load_frozen_model(snapshot_id, weights)
        self._sync_or_undo(snapshot_id, weights, None)

    def remove_model(self, model_id: str) -> None:
        self._backend.remove_model(model_id)
        self._lora.pop(model_id, None)

    def remove_snapshot(self, snapshot_id: str) -> None:
        if any(weights_id == snapshot_id for _, weights_id in self._in_flight.values()):
            raise ConflictError(f"snapshot {snapshot_id!r} still serves samples on a sampler engine")
        self._backend.remove_snapshot(snapshot_id)
        self._home.pop(snapshot_id, None)
        self._kept.pop(snapshot_id, None)
        if snapshot_id in self._synced:
            self._synced.discard(snapshot_id)
            for index in range(len(self._conns)):
                self._send(index, ("remove", snapshot_id))

    def _sync_or_undo(self, snapshot_id: str, tensors: dict[str, Any], lora: dict[str, Any] | None) -> None:
        """Every sampler engine receives the snapshot and keeps it as a frozen version; if any cannot, the save
        fails with its reason and no engine (nor the trainer) keeps it."""
        self._replace_failed()  # the sync group must be whole
        sent = {k: v.contiguous() for k, v in tensors.items()}
        try:
            errors = self._broadcast(snapshot_id, sent, lora, resync=False)
        except _EngineLost as exc:
            self._restart_everything(f"a sampler engine was lost during the weight sync of {snapshot_id!r}: {exc}")
        except BaseException:
            self._backend.remove_snapshot(snapshot_id)
            raise
        if any(errors):
            self._backend.remove_snapshot(snapshot_id)
            for index in range(len(self._conns)):
                self._send(index, ("remove", snapshot_id))
            raise next(e for e in errors if e is not None)
        self._synced.add(snapshot_id)
        if lora is not None:  # kept to catch up a replaced engine (full weights are read back from the trainer's copy)
            self._kept[snapshot_id] = ({k: v.detach().to("cpu", copy=True) for k, v in sent.items()}, lora)
        last = self._sync.last
        log.info("weight sync %d: %s (%d tensors, %.1f MB in %d buckets) to %d sampler engine(s) (%d ranks) in %.3f "
                 "s; requests served per engine so far: %s", last.version, snapshot_id, last.tensors, last.bytes / 1e6,
                 last.buckets, len(self._conns),
                 len(self._conns) * self._settings.inference_engine_tensor_parallel_size, last.seconds, self._served)

    def _broadcast(self, snapshot_id: str, sent: dict[str, Any], lora: dict[str, Any] | None,
                   resync: bool) -> list[BaseException | None]:
        """One sync to every engine; each engine's error (None: kept). Raises _EngineLost."""
        for index in range(len(self._conns)):
            if not self._send(index, ("sync", snapshot_id, lora, resync)):
                raise _EngineLost(f"sampler engine {index}: {self._failed.get(index)}")
        try:
            self._sync.sync(self._versions, sent, self._sync_device)
        except InternalError as exc:  # a collective failed: a member died or hung
            raise _EngineLost(str(exc)) from exc
        self._versions += 1
        answers = [self._receive(index, "synced") for index in range(len(self._conns))]
        errors = [answer[2] for answer in answers]
        digest = weights_digest(sent) if self._digests else None
        if digest is not None and not any(errors):
            log.info("weight sync %d digest: trainer %s, sampler engines %s", self._versions - 1, digest,
                     [answer[3] for answer in answers])
            errors = [None if answer[3] == digest else InternalError(
                f"weight sync of {snapshot_id!r}: sampler engine {index} holds other weights (digest "
                f"{answer[3]}, the trainer's {digest})") for index, answer in enumerate(answers)]
        return errors

    # ---- sampling -----------------------------------------------------------------------------------
    def submit_sample(self, request: SampleRequest) -> int:
        if request.weights_id and request.weights_id not in self._synced:
            sample_id = self._backend.submit_sample(request)  # a live model id: only the trainer has its weights
            self._local.add(sample_id)
            return sample_id
        self._replace_failed()
        sample_id = next(self._ids)
        self._requests[sample_id] = request
        if request.stream:
            self._progress[sample_id] = []  # its engine reports it every step from the first
        self._dispatch(sample_id)
        return sample_id

    def _dispatch(self, sample_id: int) -> None:
        """Sends a request to an engine. If that engine turns out lost, the request stays in flight on it and runs
        again when the engine is replaced (the next sample_step)."""
        request = self._requests[sample_id]
        index = self._route(request.weights_id)
        if not any(i == index for i, _ in self._in_flight.values()):
            self._heard[index] = time.monotonic()  # an idle engine owed nothing until now
        self._in_flight[sample_id] = (index, request.weights_id)
        self._served[index] += 1
        if self._send(index, ("submit", sample_id, request)) and sample_id in self._progress and not request.stream:
            self._send(index, ("watch", sample_id))

    def _route(self, weights_id: str) -> int:
        """The engine that served these weights last if none is less busy (its prefix cache holds their prompts),
        else the least busy, taking turns among equals. A request's num_samples stay together on one engine."""
        load = [float("inf") if i in self._failed else 0.0 for i in range(len(self._conns))]
        for index, _ in self._in_flight.values():
            load[index] += 1
        home = self._home.get(weights_id)
        if home is not None and load[home] == min(load):
            return home
        count = len(load)
        index = min(range(count), key=lambda i: (load[(self._turn + i) % count], i))
        index = (self._turn + index) % count
        self._turn = (index + 1) % count
        self._home[weights_id] = index
        return index

    def sample_step(self) -> list[tuple[int, SampleResult]]:
        self._replace_failed()
        local_running = len(self._local)
        finished = self._backend.sample_step() if local_running else []
        for sample_id, _ in finished:
            self._local.discard(sample_id)
        # Only sampler engines busy: wait briefly for their first result rather than spin the engine loop.
        self._drain(wait=WAIT_S if self._in_flight and not local_running and not self._finished else 0.0)
        finished += self._finished
        self._finished = []
        return finished

    def sample_progress(self, sample_ids: list[int]) -> dict[int, list[list[int]]]:
        local = [i for i in sample_ids if i >= 0]
        out = dict(self._backend.sample_progress(local)) if local else {}
        for sample_id in sample_ids:
            if sample_id < 0 and sample_id in self._in_flight:
                if sample_id not in self._progress:  # first ask: the engine starts reporting it
                    self._progress[sample_id] = []
                    self._send(self._in_flight[sample_id][0], ("watch", sample_id))
                out[sample_id] = self._progress[sample_id]
        return out

    def sampling_idle(self) -> bool:
        return not self._local and not self._in_flight

    def _drain(self, wait: float) -> None:
        """Takes every message the sampler engines have sent; waits up to `wait` for the first. An engine with
        requests in flight that has said nothing for inference_engine_timeout_s is hung."""
        live = [conn for i, conn in enumerate(self._conns) if i not in self._failed]
        for conn in multiprocessing.connection.wait(live, timeout=wait):
            index = self._conns.index(conn)
            while index not in self._failed and conn.poll():
                message = self._recv(index)
                if message is not None:
                    self._handle(index, message)
        now = time.monotonic()
        for index in {i for i, _ in self._in_flight.values()} - set(self._failed):
            if now - self._heard[index] > self._timeout_s:
                self._lose(index, f"hung: silent for {now - self._heard[index]:.1f} s with requests in flight "
                                  "(inference_engine_timeout_s)")

    def _handle(self, index: int, message: tuple) -> None:
        kind = message[0]
        if kind in ("done", "failed"):
            if self._in_flight.get(message[1], (None,))[0] != index:
                return  # a request that already ran again elsewhere
            self._in_flight.pop(message[1])
            self._requests.pop(message[1], None)
            self._progress.pop(message[1], None)
            self._finished.append((message[1], message[2] if kind == "done" else FailedSample(message[2])))
        elif kind == "progress":
            for sample_id, tokens in message[1].items():
                if sample_id in self._progress:
                    self._progress[sample_id] = tokens
        elif kind != "alive":
            raise InternalError(f"sampler engine {index}: unexpected message {kind!r}")

    # ---- pipes and faults ---------------------------------------------------------------------------
    def _send(self, index: int, message: tuple) -> bool:
        """False when the engine is lost (now or before)."""
        if index in self._failed:
            return False
        try:
            self._conns[index].send(message)
            return True
        except OSError as exc:  # BrokenPipeError: it died since the last message
            self._lose(index, f"gone ({type(exc).__name__}: {exc})")
            return False

    def _recv(self, index: int) -> tuple | None:
        """The engine's next message; None when it is lost."""
        try:
            message = self._conns[index].recv()
        except (EOFError, OSError) as exc:
            self._lose(index, f"gone ({type(exc).__name__}: {exc})")
            return None
        self._heard[index] = time.monotonic()
        return message

    def _receive(self, index: int, kind: str, timeout_s: float | None = None) -> tuple:
        """The next message of `kind` from engine `index`; results arriving first are kept. Raises _EngineLost when
        it is lost or silent for `timeout_s` (default inference_engine_timeout_s)."""
        timeout_s = self._timeout_s if timeout_s is None else timeout_s
        while True:
            if index in self._failed:
                raise _EngineLost(f"sampler engine {index} {self._failed[index]}")
            if not self._conns[index].poll(timeout_s):
                self._lose(index, f"hung: no answer within {timeout_s:g} s")
                continue
            message = self._recv(index)
            if message is not None and message[0] == kind:
                return message
            if message is not None:
                self._handle(index, message)

    def _lose(self, index: int, why: str) -> None:
        """Marks an engine lost (killing it, if it still runs): its requests wait for its replacement."""
        if index in self._failed:
            return
        self._failed[index] = why
        self._procs[index].kill()
        log.warning("sampler engine %d (pid %s) is %s; it will be replaced", index, self._procs[index].pid, why)

    def _replace_failed(self) -> None:
        """Replaces every lost engine: the others and the new ones join a fresh sync group, the new ones receive
        every live version again (LoRA factors kept here; full weights read back from the trainer's frozen copy),
        and the lost engines' requests run again. On any failure on the way, the engine process restarts with its
        sampler engines instead."""
        if not self._failed:
            return
        lost, started = dict(self._failed), time.monotonic()
        try:
            self._regroup(sorted(lost))
            self._failed.clear()
            for snapshot_id in sorted(self._synced):
                tensors, lora = self._kept.get(snapshot_id) or (self._backend.frozen_model_weights(snapshot_id), None)
                errors = self._broadcast(snapshot_id, tensors, lora, resync=True)
                if any(errors):
                    raise _EngineLost(f"re-sync of {snapshot_id!r}: {next(e for e in errors if e is not None)}")
        except _EngineLost as exc:
            self._restart_everything(f"replacing sampler engine(s) {lost} failed: {exc}")
        again = [sample_id for sample_id, (index, _) in self._in_flight.items() if index in lost]
        for sample_id in again:
            self._dispatch(sample_id)
        log.warning("replaced sampler engine(s) %s (now pids %s) in %.1f s: %d version(s) re-synced, %d request(s) "
                    "running again", lost, [self._procs[i].pid for i in lost], time.monotonic() - started,
                    len(self._synced), len(again))

    def _regroup(self, indices: list[int]) -> None:
        """Starts engines `indices` and makes a fresh sync group of the trainer, them and the other engines."""
        from skyrl_tx.parallel.weight_sync import join_sync_group
        from skyrl_tx.ports import free_local_port

        count = len(self._conns)
        width = self._settings.inference_engine_tensor_parallel_size  # each engine rank is a sync-group rank
        address = f"127.0.0.1:{free_local_port()}"
        others = [i for i in range(count) if i not in indices]
        for index in others:
            if not self._send(index, ("regroup", address)):
                raise _EngineLost(f"sampler engine {index} {self._failed[index]}")
        context = multiprocessing.get_context("spawn")
        for index in indices:
            parent, child = context.Pipe()
            # An engine of inference_engine_tensor_parallel_size ranks: the engine process and its own workers.
            settings = {**dataclasses.asdict(self._settings), "colocate_all": True, "num_inference_engines": 1,
                        "fully_sharded_data_parallel_size": 1, "num_processes": 1, "coordinator_address": "",
                        "tensor_parallel_size": self._settings.inference_engine_tensor_parallel_size,
                        # an engine spreads the experts over its own tensor-parallel ranks, or holds them all
                        "expert_parallel_size": (self._settings.inference_engine_tensor_parallel_size
                                                 if self._settings.expert_parallel_size > 1 else 1),
                        "inference_engine_tensor_parallel_size": 1, "inference_engine_devices": (),
                        "device": sampler_device(self._settings, index)}
            proc = context.Process(target=sampler_engine_main, args=(str(self._model_dir), settings,
                                                                     1 + index * width, 1 + count * width, address,
                                                                     child, self._sync_on_cuda),
                                   # a daemon may not start processes: a tensor-parallel engine starts its ranks
                                   # (they die with it: PR_SET_PDEATHSIG; close() stops it)
                                   daemon=self._settings.inference_engine_tensor_parallel_size == 1,
                                   name=f"skyrl-tx-sampler-{index}")
            proc.start()
            self._conns[index], self._procs[index] = parent, proc
            self._failed.pop(index, None)
        self._sync = None  # the old group (a member is gone) before the new one
        try:
            self._sync = join_sync_group(address, 0, 1 + count * width, device=self._sync_device)
        except InternalError as exc:
            raise _EngineLost(str(exc)) from exc
        for index in indices:
            self._receive(index, "ready", timeout_s=JOIN_TIMEOUT_S)
        for index in others:
            self._receive(index, "regrouped", timeout_s=JOIN_TIMEOUT_S)

    def _restart_everything(self, why: str) -> NoReturn:
        """The engine process exits before storing anything more (as when a data-parallel rank dies); the
        supervisor restarts it with fresh sampler engines, recovery rebuilds the sampler snapshots, and the
        unfinished requests run again."""
        log.critical("%s; the engine restarts with its sampler engines", why)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(GROUP_BROKEN_EXIT)

    def close(self) -> None:
        for conn, proc in zip(self._conns, self._procs):
            try:
                conn.send(("stop",))
            except OSError:
                pass
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        self._backend.close()

