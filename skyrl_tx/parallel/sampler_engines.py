"""Disaggregated placement (`colocate_all: false`): sampler engines in processes of their own, each with its own
device, copy of the base model and KV cache, kept current by weight syncs from the trainer (the engine process).

SamplerEnginesBackend wraps the engine's backend for the engine loop, as ExternalSamplingBackend does for vLLM:
training stays where it is; every sampler snapshot the trainer makes (save_weights_for_sampler, ephemeral syncs,
sampler checkpoints loaded from storage, full-model snapshots moved back from disk) is sent to every sampler engine
through WeightSync over a c10d group (csrc/dist/weight_sync.h: Gloo on CPU, NCCL on GPUs), never through the disk,
and kept there as a frozen version; each sample request of the base model or of a synced snapshot runs on the
sampler engine with the fewest requests in flight (a request's num_samples together). Anything else (sampling a
live model id) runs on the trainer, as colocated. The engine processes' side: parallel/sampler_engine_process.py.

A sampler engine that dies or hangs is replaced without stopping anything else (parallel/sampler_engine_pool.py):
its requests go at once to the live engines (or wait, bounded, for one when none is live), and its replacement
loads the model in the background; training, weight syncs and the other engines' sampling go on meanwhile (a sync
then reaches the live engines only, in a sync group rebuilt without the lost one). Once the replacement holds the
model it joins a new sync group with the others and receives every live version again (LoRA factors the trainer
keeps; full weights read back from the trainer's own frozen copy of the snapshot); only then does it serve. An
engine lost in the middle of a sync is dropped from it: the survivors regroup and the sync is retried for them (a
version a survivor received before the failure is received again and dropped), with no restart of the engine
process.

Commands and results travel over one pipe per sampler engine; the engine loop's single thread is the only caller.
The trainer may be rank 0 of a data-parallel group: the sync group is a group of its own (parallel/group.py
join_side_group). A sampler engine of T tensor-parallel ranks puts every rank in the sync group (the trainer is rank
0, the group's m-th member engine's ranks 1 + m*T ... m*T + T): each receives the broadcast itself and keeps its part.
The group's collectives and joins time out after max(60 s, inference_engine_timeout_s) (its members hold the model
already); before, a join waited up to the 600 s a model load may take.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing.connection
import random
import time
from pathlib import Path
from typing import Any

from skyrl_tx.config import BackendSettings
from skyrl_tx.errors import ConflictError, InternalError
from skyrl_tx.parallel.layout import sampler_device, weight_sync_on_cuda
from skyrl_tx.parallel.sampler_engine_pool import EngineLost, SamplerEnginePool
from skyrl_tx.parallel.weight_sync import JOIN_TIMEOUT_S, weights_digest
from skyrl_tx.types import FailedSample, SampleRequest, SampleResult

log = logging.getLogger("skyrl_tx.parallel")

WAIT_S = 0.02  # sample_step waits this long for a remote result when nothing else is running
NO_ENGINE_WAIT_S = JOIN_TIMEOUT_S  # a sample waits this long for a live engine when none is, then fails


class SamplerEnginesBackend:
    """The engine's backend with sampling on sampler engine processes (see the module docstring). Every attribute
    not defined here is the wrapped backend's own; only the engine thread calls it."""

    def __init__(self, backend: Any, model_dir: Path, settings: BackendSettings):
        self._backend, self._settings = backend, settings
        count = settings.num_inference_engines
        self._digests = settings.weight_sync_digests
        # NCCL when the trainer and every engine are on CUDA devices: the trainer sends from its own device
        sync_on_cuda = weight_sync_on_cuda(settings)
        self._sync_device = settings.device if sync_on_cuda else "cpu"
        self._pool = SamplerEnginePool(model_dir, settings, sync_on_cuda, self._sync_device)
        self._pool.on_message = self._handle
        self._lora: dict[str, dict[str, Any] | None] = {}  # live model id → its LoRA shape (None: full weights)
        self._synced: set[str] = set()  # snapshot ids every live sampler engine holds
        self._kept: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}  # LoRA versions: factors, shape
        # Unseeded requests' seeds, from one stream as one process has: every engine's own stream starts at the same
        # seed, so two engines would otherwise draw the same "random" samples (and a rerun on another engine, after
        # its first one was lost, now draws what the first would have).
        self._seeds = random.Random(int(settings.seed))
        self._ids = itertools.count(-1, -1)  # the samplers' request ids: negative, apart from the trainer's own
        # id → (sampler engine, or None while it waits for a live one; weights id)
        self._in_flight: dict[int, tuple[int | None, str]] = {}
        self._requests: dict[int, SampleRequest] = {}  # id → the request, to run again if its engine is lost
        self._waiting_since: dict[int, float] = {}  # ids waiting for a live engine → since when
        self._lost_why: dict[int, str] = {}  # engines being replaced → why they were lost (for the log)
        self._local: set[int] = set()  # ids of requests running on the trainer (live model ids)
        self._served = [0] * count  # requests sent to each sampler engine
        self._versions = 0  # syncs so far
        self._home: dict[str, int] = {}  # weights id → the engine that served it last
        self._turn = 0  # where the next tie-break among equally busy engines starts
        self._progress: dict[int, list[list[int]]] = {}
        self._finished: list[tuple[int, SampleResult]] = []
        try:
            self._pool.start_all()
        except EngineLost as exc:
            self._pool.close()
            raise InternalError(f"sampler engines did not start: {exc}") from exc
        kv_cache = (f"the rows that fit in gpu_memory_utilization={settings.gpu_memory_utilization}"
                    if settings.gpu_memory_utilization else f"{settings.max_sampling_sequences} rows")
        log.info("sampling on %d sampler engine(s) of %d tensor-parallel rank(s) each (pids %s, first devices %s), "
                 "each with a KV cache of %s of %d tokens; weights synced over c10d", count,
                 settings.inference_engine_tensor_parallel_size, [p.pid for p in self._pool.procs],
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
        # A full model's weights travel in the dtype the model holds them (what each engine keeps), not as float32
        # host copies: a bf16 8B model sends 16 GB instead of copying 32 GB on the engine thread first.
        tensors = (self._backend.adapter_state_dict(model_id) if lora is not None
                   else self._backend.trainable_state(model_id, model_dtype=True))
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
            for index in self._pool.live():  # a replacement not admitted yet catches up on what is left
                self._pool.send(index, ("remove", snapshot_id))

    def _sync_or_undo(self, snapshot_id: str, tensors: dict[str, Any], lora: dict[str, Any] | None) -> None:
        """Every live sampler engine receives the snapshot and keeps it as a frozen version (an engine lost on the
        way is dropped from the sync, which is retried for the others; a replacement catches up when admitted);
        if any cannot keep it, the save fails with its reason and no engine (nor the trainer) keeps it."""
        self._tend()
        sent = {k: v.contiguous() for k, v in tensors.items()}
        answers: list[tuple] = []
        try:
            for attempt in range(len(self._served) + 1):
                try:
                    if self._pool.members != self._pool.live():  # an engine was lost since the last sync
                        self._pool.regroup(self._pool.live())
                    if self._pool.members:
                        # a retry: a survivor that received the version before the failure drops the copy
                        answers = self._broadcast(snapshot_id, sent, lora, resync=attempt > 0)
                    break
                except EngineLost as exc:
                    log.warning("sampler engine lost while %r was sent to the sampler engines (%s); sending it again "
                                "to the live ones %s", snapshot_id, exc, self._pool.live())
            else:
                raise InternalError(f"the sampler engines kept being lost while {snapshot_id!r} was sent to them")
        except BaseException:
            self._undo(snapshot_id)
            raise
        self._restart_lost()  # an engine lost in the sync: its replacement starts now, its requests go elsewhere
        errors = [answer[3] for answer in answers]
        if any(errors):
            self._undo(snapshot_id)
            raise next(e for e in errors if e is not None)
        self._synced.add(snapshot_id)
        if lora is not None:  # kept to catch up a replaced engine (full weights are read back from the trainer's copy)
            self._kept[snapshot_id] = ({k: v.detach().to("cpu", copy=True) for k, v in sent.items()}, lora)
        if self._pool.sync is None:
            log.info("%s kept for the sampler engines being replaced (none is live)", snapshot_id)
            return
        last, members = self._pool.sync.last, len(self._pool.members)
        log.info("weight sync %d: %s (%d tensors, %.1f MB in %d buckets) to %d sampler engine(s) (%d ranks) in %.3f "
                 "s; requests served per engine so far: %s", last.version, snapshot_id, last.tensors, last.bytes / 1e6,
                 last.buckets, members, members * self._settings.inference_engine_tensor_parallel_size,
                 last.seconds, self._served)

    def _undo(self, snapshot_id: str) -> None:
        self._backend.remove_snapshot(snapshot_id)
        for index in self._pool.live():
            self._pool.send(index, ("remove", snapshot_id))

    def _broadcast(self, snapshot_id: str, sent: dict[str, Any], lora: dict[str, Any] | None,
                   resync: bool) -> list[tuple]:
        """One sync to every member of the sync group; their answers, digests checked. Raises EngineLost."""
        answers = self._pool.broadcast(snapshot_id, sent, lora, resync, self._versions)
        self._versions += 1
        digest = weights_digest(sent) if self._digests else None
        if digest is not None and not any(answer[3] for answer in answers):
            log.info("weight sync %d digest: trainer %s, sampler engines %s", self._versions - 1, digest,
                     [answer[4] for answer in answers])
            answers = [answer if answer[4] == digest else (*answer[:3], InternalError(
                f"weight sync of {snapshot_id!r}: sampler engine {index} holds other weights (digest "
                f"{answer[4]}, the trainer's {digest})"), answer[4])
                for index, answer in zip(self._pool.members, answers)]
        return answers

    # ---- replacing lost engines, off the loop ---------------------------------------------------------
    def _tend(self) -> None:
        """Never waits for a model to load: starts a replacement for every lost engine and sends its requests to
        the live ones (or lets them wait for one), admits the replacements that hold the model now, and sends the
        waiting requests to a live engine."""
        self._restart_lost()
        loaded = self._pool.poll_starting()
        if loaded:
            self._admit(loaded)
            self._restart_lost()
        waiting = [i for i, (index, _) in self._in_flight.items() if index is None]
        if waiting and self._pool.live():
            for sample_id in waiting:
                self._dispatch(sample_id)
        elif waiting:
            now, hopeless = time.monotonic(), not self._pool.starting and not self._pool.lost
            for sample_id in waiting:
                if hopeless or now - self._waiting_since[sample_id] > NO_ENGINE_WAIT_S:
                    self._finish(sample_id, FailedSample(InternalError(
                        f"no sampler engine came up within {NO_ENGINE_WAIT_S:g} s to run this request" if not
                        hopeless else "no sampler engine is left: every replacement failed to start (see the log)")))

    def _restart_lost(self) -> None:
        lost = self._pool.restart_lost()
        if not lost:
            return
        self._lost_why.update(lost)
        moved = [sample_id for sample_id, (index, _) in self._in_flight.items() if index in lost]
        for sample_id in moved:  # their results from the lost engine can no longer come: they run once, elsewhere
            self._in_flight[sample_id] = (None, self._in_flight[sample_id][1])
            self._waiting_since[sample_id] = time.monotonic()
        live = self._pool.live()
        for sample_id in moved if live else ():
            self._dispatch(sample_id)
        log.warning("sampler engine(s) %s lost: a replacement loads the model in the background; %d request(s) "
                    "%s", sorted(lost), len(moved), f"sent to engine(s) {live}" if live else "wait for an engine")

    def _admit(self, loaded: list[int]) -> None:
        """The loaded replacements join a new sync group with the live engines and receive every live version
        (the others receive it too and drop it); then they serve. One lost on the way is started again."""
        started = time.monotonic()
        try:
            self._pool.regroup(sorted(self._pool.live() + loaded))
            for snapshot_id in sorted(self._synced):
                tensors, lora = self._kept.get(snapshot_id) or (self._backend.frozen_model_weights(snapshot_id), None)
                for index, answer in zip(self._pool.members, self._broadcast(snapshot_id, tensors, lora, True)):
                    if answer[3] is not None:
                        self._pool.lose(index, f"could not keep {snapshot_id!r} when it caught up: {answer[3]}")
                        raise EngineLost(str(answer[3]))
        except EngineLost as exc:
            if not any(index not in loaded for index in self._pool.lost):  # (_tend restarted the lost ones first)
                self._pool.admission_failed(loaded)  # no other engine to blame: bounded, then given up
            log.warning("admitting the replaced sampler engine(s) %s failed (%s); trying again", loaded, exc)
            return
        for index in loaded:
            self._pool.admitted(index)
        lost = {index: self._lost_why.pop(index, "lost") for index in loaded}
        log.warning("replaced sampler engine(s) %s (now pids %s): admitted %.1f s after loading the model, %d "
                    "version(s) re-synced", lost, [self._pool.procs[i].pid for i in loaded],
                    time.monotonic() - started, len(self._synced))

    # ---- sampling -----------------------------------------------------------------------------------
    def submit_sample(self, request: SampleRequest) -> int:
        if request.weights_id and request.weights_id not in self._synced:
            sample_id = self._backend.submit_sample(request)  # a live model id: only the trainer has its weights
            self._local.add(sample_id)
            return sample_id
        self._tend()
        request = request.seeded_from(self._seeds)
        sample_id = next(self._ids)
        self._requests[sample_id] = request
        if request.stream:
            self._progress[sample_id] = []  # its engine reports it every step from the first
        self._waiting_since[sample_id] = time.monotonic()
        self._in_flight[sample_id] = (None, request.weights_id)
        if self._pool.live():
            self._dispatch(sample_id)
        return sample_id

    def _dispatch(self, sample_id: int) -> None:
        """Sends a request to a live engine. If that engine turns out lost, the request goes to another one at the
        next _tend (this step's or the next one's)."""
        request = self._requests[sample_id]
        index = self._route(request.weights_id)
        if not any(i == index for i, _ in self._in_flight.values()):
            self._pool.heard[index] = time.monotonic()  # an idle engine owed nothing until now
        self._in_flight[sample_id] = (index, request.weights_id)
        self._waiting_since.pop(sample_id, None)
        self._served[index] += 1
        if self._pool.send(index, ("submit", sample_id, request)) and sample_id in self._progress and \
                not request.stream:
            self._pool.send(index, ("watch", sample_id))

    def _route(self, weights_id: str) -> int:
        """The engine that served these weights last if none is less busy (its prefix cache holds their prompts),
        else the least busy, taking turns among equals. A request's num_samples stay together on one engine."""
        live = set(self._pool.live())
        load = [0.0 if i in live else float("inf") for i in range(len(self._served))]
        for index, _ in self._in_flight.values():
            if index is not None:
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
        self._tend()
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
                index = self._in_flight[sample_id][0]
                if sample_id not in self._progress:  # first ask: the engine starts reporting it (once sent to one)
                    self._progress[sample_id] = []
                    if index is not None:
                        self._pool.send(index, ("watch", sample_id))
                out[sample_id] = self._progress[sample_id]
        return out

    def sampling_idle(self) -> bool:
        return not self._local and not self._in_flight

    def _drain(self, wait: float) -> None:
        """Takes every message the live sampler engines have sent; waits up to `wait` for the first. An engine with
        requests in flight that has said nothing for inference_engine_timeout_s is hung."""
        pool = self._pool
        conns = {pool.conns[i]: i for i in pool.live()}
        if not conns:  # every engine is being replaced: the waiting requests go out at a later _tend
            time.sleep(wait)
        for conn in multiprocessing.connection.wait(list(conns), timeout=wait) if conns else []:
            index = conns[conn]
            while index not in pool.lost and conn.poll():
                message = pool.recv(index)
                if message is not None:
                    self._handle(index, message)
        now = time.monotonic()
        for index in {i for i, _ in self._in_flight.values() if i is not None} - set(pool.lost):
            if now - pool.heard[index] > pool.timeout_s:
                pool.lose(index, f"hung: silent for {now - pool.heard[index]:.1f} s with requests in flight "
                                 "(inference_engine_timeout_s)")

    def _handle(self, index: int, message: tuple) -> None:
        kind = message[0]
        if kind in ("done", "failed"):
            if self._in_flight.get(message[1], (None,))[0] != index:
                return  # a request that already ran again elsewhere
            self._finish(message[1], message[2] if kind == "done" else FailedSample(message[2]))
        elif kind == "progress":
            for sample_id, tokens in message[1].items():
                if sample_id in self._progress:
                    self._progress[sample_id] = tokens
        elif kind not in ("alive", "synced", "regrouped"):  # (answers to a sync or regroup abandoned)
            raise InternalError(f"sampler engine {index}: unexpected message {kind!r}")

    def _finish(self, sample_id: int, result: SampleResult) -> None:
        """The request's one result: it leaves every table, so nothing can run or return it again."""
        self._in_flight.pop(sample_id)
        self._requests.pop(sample_id, None)
        self._progress.pop(sample_id, None)
        self._waiting_since.pop(sample_id, None)
        self._finished.append((sample_id, result))

    def close(self) -> None:
        self._pool.close()
        self._backend.close()
