"""Disaggregated placement (`colocate_all: false`): sampler engines in processes of their own, each with its own
device, copy of the base model and KV cache, kept current by weight syncs from the trainer (the engine process).

SamplerEnginesBackend wraps the engine's backend for the engine loop, as ExternalSamplingBackend does for vLLM:
training stays where it is; every sampler snapshot the trainer makes (save_weights_for_sampler, ephemeral syncs,
sampler checkpoints loaded from storage, full-model snapshots moved back from disk) is sent to every sampler engine
through WeightSync over a c10d group (csrc/dist/weight_sync.h: Gloo on CPU, NCCL on GPUs), never through the disk,
and kept there as a frozen version; each sample request of the base model or of a synced snapshot runs on the
sampler engine with the fewest requests in flight (a request's num_samples together). Anything else (sampling a
live model id) runs on the trainer, as colocated.

Commands and results travel over one pipe per sampler engine; the engine loop's single thread is the only caller.
The trainer may be rank 0 of a data-parallel group: the sync group is a group of its own (parallel/group.py
join_side_group). Not built yet: restarting one sampler engine alone (the engine process exits, and the supervisor
restarts it with its samplers), and tensor-parallel sampler engines.
"""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import time
from pathlib import Path
from typing import Any, NoReturn

from skyrl_tx.config import BackendSettings
from skyrl_tx.errors import ConflictError, InternalError
from skyrl_tx.parallel.weight_sync import weights_digest
from skyrl_tx.types import SampleRequest, SampleResult

log = logging.getLogger("skyrl_tx.parallel")

JOIN_TIMEOUT_S = 600.0  # a sampler engine loads the base model before it joins the sync group
WAIT_S = 0.02  # sample_step waits this long for a remote result when nothing else is running
SYNC_BUCKET_BYTES = 64 << 20
HEARTBEAT_S = 1.0  # a sampler engine decoding with nothing to report says it is alive this often
GROUP_BROKEN_EXIT = 75  # the engine process's exit code when a sampler engine died (the supervisor restarts it)


class FailedSample(SampleResult):
    """A sample request a sampler engine refused or failed: no sequences; the engine loop stores `error`."""

    def __init__(self, error: BaseException):
        super().__init__([])
        self.error = error


def _sampler_main(model_dir: str, settings: dict[str, Any], rank: int, world: int, address: str, conn: Any) -> None:
    """A sampler engine: loads the base model, joins the sync group, then serves commands until told to stop."""
    try:  # dies with the engine process, even a kill -9 of it
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    from skyrl_tx.backend.native import NativeBackend
    from skyrl_tx.parallel.group import RankAddress, join_side_group
    from skyrl_tx.parallel.weight_sync import make_weight_sync, weights_digest

    backend = NativeBackend(Path(model_dir), BackendSettings.from_dict(settings))
    digests = backend.settings.weight_sync_digests
    sync = make_weight_sync(join_side_group(RankAddress(address, rank, world), timeout_s=JOIN_TIMEOUT_S), root=0,
                            bucket_bytes=SYNC_BUCKET_BYTES)
    running: dict[int, int] = {}  # local sample id → the trainer's id
    watched: set[int] = set()  # the trainer's ids whose progress it asked for (streaming)
    conn.send(("ready", os.getpid()))
    last_sent = time.monotonic()
    while True:
        if conn.poll(0 if running else None):
            message = conn.recv()
            kind = message[0]
            if kind == "stop":
                return
            if kind == "submit":
                _, sample_id, request = message
                try:
                    running[backend.submit_sample(request)] = sample_id
                except Exception as exc:  # noqa: BLE001 - the request's error, reported to the trainer
                    conn.send(("failed", sample_id, exc))
            elif kind == "sync":  # the trainer broadcasts right after sending this: join it at once
                _, snapshot_id, lora = message
                tensors = sync.sync(0, {}, "cpu")  # the group is Gloo; loading copies to the device
                digest = weights_digest(tensors) if digests else None
                error = None
                try:
                    if lora is not None:
                        backend.load_snapshot(snapshot_id, tensors, **lora)
                    else:
                        backend.load_frozen_model(snapshot_id, {k: v.clone() for k, v in tensors.items()})
                except Exception as exc:  # noqa: BLE001 - reported to the trainer, which undoes the snapshot
                    error = exc
                conn.send(("synced", snapshot_id, error, digest))
            elif kind == "remove":
                if backend.has_snapshot(message[1]):
                    backend.remove_snapshot(message[1])
            elif kind == "watch":
                watched.add(message[1])
            continue  # every queued command before the next decode step
        finished = backend.sample_step()
        for local_id, result in finished:
            sample_id = running.pop(local_id)
            watched.discard(sample_id)
            conn.send(("done", sample_id, result))
        mine = {local: remote for local, remote in running.items() if remote in watched}
        if mine:
            progress = backend.sample_progress(list(mine))
            conn.send(("progress", {mine[local]: tokens for local, tokens in progress.items()}))
        if finished or mine:
            last_sent = time.monotonic()
        elif running and time.monotonic() - last_sent >= HEARTBEAT_S:  # decoding, nothing to report: alive
            conn.send(("alive",))
            last_sent = time.monotonic()


class SamplerEnginesBackend:
    """The engine's backend with sampling on sampler engine processes (see the module docstring). Every attribute
    not defined here is the wrapped backend's own; only the engine thread calls it."""

    def __init__(self, backend: Any, model_dir: Path, settings: BackendSettings):
        from skyrl_tx.parallel.group import RankAddress, join_side_group
        from skyrl_tx.parallel.weight_sync import make_weight_sync
        from skyrl_tx.ports import free_local_port

        self._backend = backend
        count = settings.num_inference_engines
        self._timeout_s = settings.inference_engine_timeout_s
        self._digests = settings.weight_sync_digests
        self._heard = [time.monotonic()] * count  # when each engine last sent anything
        address = f"127.0.0.1:{free_local_port()}"
        context = multiprocessing.get_context("spawn")
        self._conns, self._procs = [], []
        for index in range(count):
            parent, child = context.Pipe()
            sampler_settings = {**dataclasses.asdict(settings), "colocate_all": True, "num_inference_engines": 1,
                                "fully_sharded_data_parallel_size": 1, "num_processes": 1, "coordinator_address": "",
                                "device": sampler_device(settings, index)}
            proc = context.Process(target=_sampler_main, args=(str(model_dir), sampler_settings, index + 1, count + 1,
                                                               address, child), daemon=True,
                                   name=f"skyrl-tx-sampler-{index}")
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)
        group = join_side_group(RankAddress(address, 0, count + 1), timeout_s=JOIN_TIMEOUT_S)
        self._sync = make_weight_sync(group, root=0, bucket_bytes=SYNC_BUCKET_BYTES)
        for index, conn in enumerate(self._conns):
            ready = self._receive(index, timeout_s=JOIN_TIMEOUT_S)
            if ready[0] != "ready":
                raise InternalError(f"sampler engine {index} did not start: {ready!r}")
        self._lora: dict[str, dict[str, Any] | None] = {}  # live model id → its LoRA shape (None: full weights)
        self._synced: set[str] = set()  # snapshot ids every sampler engine holds
        self._ids = itertools.count(-1, -1)  # the samplers' request ids: negative, apart from the trainer's own
        self._in_flight: dict[int, tuple[int, str]] = {}  # id → (sampler engine, weights id)
        self._local: set[int] = set()  # ids of requests running on the trainer (live model ids)
        self._served = [0] * count  # requests sent to each sampler engine
        self._versions = 0  # syncs so far
        self._home: dict[str, int] = {}  # weights id → the engine that served it last
        self._turn = 0  # where the next tie-break among equally busy engines starts
        self._progress: dict[int, list[list[int]]] = {}
        self._finished: list[tuple[int, SampleResult]] = []
        log.info("sampling on %d sampler engine(s) (pids %s, devices %s), weights synced over c10d", count,
                 [p.pid for p in self._procs], [sampler_device(settings, i) for i in range(count)])

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
        if snapshot_id in self._synced:
            self._synced.discard(snapshot_id)
            for index in range(len(self._conns)):
                self._send(index, ("remove", snapshot_id))

    def _sync_or_undo(self, snapshot_id: str, tensors: dict[str, Any], lora: dict[str, Any] | None) -> None:
        """Every sampler engine receives the snapshot and keeps it as a frozen version; if any cannot, the save
        fails with its reason and no engine (nor the trainer) keeps it."""
        try:
            for index in range(len(self._conns)):
                self._send(index, ("sync", snapshot_id, lora))
            sent = {k: v.contiguous() for k, v in tensors.items()}
            self._sync.sync(self._versions, sent, "cpu")
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
        except BaseException:
            self._backend.remove_snapshot(snapshot_id)
            raise
        if any(errors):
            self._backend.remove_snapshot(snapshot_id)
            for index in range(len(self._conns)):
                self._send(index, ("remove", snapshot_id))
            raise next(e for e in errors if e is not None)
        self._synced.add(snapshot_id)
        last = self._sync.last
        log.info("weight sync %d: %s (%d tensors, %.1f MB in %d buckets) to %d sampler engine(s) in %.3f s; requests "
                 "served per engine so far: %s", last.version, snapshot_id, last.tensors, last.bytes / 1e6,
                 last.buckets, len(self._conns), last.seconds, self._served)

    # ---- sampling -----------------------------------------------------------------------------------
    def submit_sample(self, request: SampleRequest) -> int:
        if request.weights_id and request.weights_id not in self._synced:
            sample_id = self._backend.submit_sample(request)  # a live model id: only the trainer has its weights
            self._local.add(sample_id)
            return sample_id
        index = self._route(request.weights_id)
        if not any(i == index for i, _ in self._in_flight.values()):
            self._heard[index] = time.monotonic()  # an idle engine owed nothing until now
        sample_id = next(self._ids)
        self._send(index, ("submit", sample_id, request))
        self._in_flight[sample_id] = (index, request.weights_id)
        self._served[index] += 1
        return sample_id

    def _route(self, weights_id: str) -> int:
        """The engine that served these weights last if none is less busy (its prefix cache holds their prompts),
        else the least busy, taking turns among equals. A request's num_samples stay together on one engine."""
        load = [0] * len(self._conns)
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
        ready = multiprocessing.connection.wait(self._conns, timeout=wait)
        for conn in ready:
            while conn.poll():
                self._handle(self._conns.index(conn), self._recv(conn))
        now = time.monotonic()
        for index in {i for i, _ in self._in_flight.values()}:
            if now - self._heard[index] > self._timeout_s:
                self._engine_hung(index, f"silent for {now - self._heard[index]:.1f} s with requests in flight")

    def _handle(self, index: int, message: tuple) -> None:
        kind = message[0]
        if kind == "done":
            self._in_flight.pop(message[1], None)
            self._progress.pop(message[1], None)
            self._finished.append((message[1], message[2]))
        elif kind == "failed":
            self._in_flight.pop(message[1], None)
            self._progress.pop(message[1], None)
            self._finished.append((message[1], FailedSample(message[2])))
        elif kind == "alive":
            pass
        elif kind == "progress":
            for sample_id, tokens in message[1].items():
                if sample_id in self._progress:
                    self._progress[sample_id] = tokens
        else:
            raise InternalError(f"sampler engine {index}: unexpected message {kind!r}")

    def _receive(self, index: int, kind: str | None = None, timeout_s: float | None = None) -> tuple:
        """The next message of `kind` from engine `index`; results arriving first are kept. An engine silent for
        `timeout_s` (default inference_engine_timeout_s) is hung."""
        timeout_s = self._timeout_s if timeout_s is None else timeout_s
        while True:
            if not self._conns[index].poll(timeout_s):
                self._engine_hung(index, f"no answer within {timeout_s:g} s")
            message = self._recv(self._conns[index])
            if kind is None or message[0] == kind:
                return message
            self._handle(index, message)

    def _recv(self, conn: Any) -> tuple:
        index = self._conns.index(conn)
        try:
            message = conn.recv()
        except (EOFError, OSError) as exc:
            self._engine_gone(index, exc)
        self._heard[index] = time.monotonic()
        return message

    def _engine_hung(self, index: int, why: str) -> NoReturn:
        """A hung sampler engine is killed, then handled as a dead one."""
        self._procs[index].kill()
        self._engine_gone(index, TimeoutError(f"sampler engine hung ({why}; inference_engine_timeout_s)"))

    def _send(self, index: int, message: tuple) -> None:
        try:
            self._conns[index].send(message)
        except OSError as exc:  # BrokenPipeError: it died since the last message
            self._engine_gone(index, exc)

    def _engine_gone(self, index: int, exc: BaseException) -> NoReturn:
        """A sampler engine died: its requests must not fail, and its kept versions are lost. The engine process
        exits before storing anything more (as when a data-parallel rank dies); the supervisor restarts it with fresh
        sampler engines, recovery rebuilds the sampler snapshots, and the unfinished requests run again."""
        log.critical("sampler engine %d (pid %s) is gone (%s: %s); the engine restarts with its sampler engines",
                     index, self._procs[index].pid, type(exc).__name__, exc)
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
        close = getattr(self._backend, "close", None)
        if close is not None:
            close()


def sampler_device(settings: BackendSettings, index: int) -> str:
    """Sampler engine `index`'s device: on a GPU node the devices after the trainer's ranks (with 2 data-parallel
    ranks on cuda:0 and cuda:1, the sampler engines use cuda:2, cuda:3, ...)."""
    if settings.device == "cpu":
        return "cpu"
    first = int(settings.device.split(":", 1)[1]) if ":" in settings.device else 0
    trainer_ranks_here = settings.fully_sharded_data_parallel_size // max(settings.num_processes, 1)
    return f"cuda:{first + trainer_ranks_here + index}"
