"""EngineLoop: one step = claim pending futures → batch per model in seq_id order → run on the backend → store."""

from __future__ import annotations

import logging
import random
import time
from collections import defaultdict
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from skyrl_tx.db import future_queries, unload_requests
from skyrl_tx.db.future_queries import FutureOutcome, FutureRow, Notify
from skyrl_tx.db.session import bound_engine
from skyrl_tx.db.models import (FutureRecord, FutureStatus, ModelRecord, ModelStatus, SamplingSessionRecord,
                                SessionRecord, SessionStatus)
from skyrl_tx.engine import executor, recovery_state, replay, snapshots
from skyrl_tx.engine.checkpointing import Checkpointer
from skyrl_tx.engine.seq_order import SeqOrder
from skyrl_tx.engine.stats import EngineStats
from skyrl_tx.errors import ConflictError, ErrorCode, NotFoundError, SkyrlTxError, UnimplementedError

log = logging.getLogger("skyrl_tx.engine")

TRAIN_TYPES = ("forward_backward", "forward")  # batched across models; everything else is a per-model barrier
# Training and sampling share the device: after a training pass of T s, decoding is owed T * share / (1 - share)
# s (backend-config sampling_share), paid before the next pass, so that neither starves the other.
DEFAULT_SAMPLING_SHARE = 0.5
MAX_DECODE_CREDIT_S = 10.0  # bounds what one very long training pass can make the next one wait
DECODE_SLICE_S = 0.05  # decode this long at most between scans, so new samples join the running batch
MAX_ATTEMPTS = 3  # engine crashes a single request may cause before it is failed instead of retried


def _writes_files(f: FutureRow) -> bool:
    """Saves that write a checkpoint directory (an unnamed sampler snapshot lives in memory only)."""
    return f.request_type in ("save_weights", "save_weights_external") or (
        f.request_type == "save_weights_for_sampler" and not f.request.get("sampling_session_id"))


def _named(f: FutureRow) -> str:
    """A request in the engine's log: its future id and the X-Request-Id the API logged for it (api/request_ids.py)."""
    request_id = getattr(f, "request_id", None)
    return f"{f.id} request_id={request_id}" if request_id else f.id


def _error(exc: BaseException) -> dict[str, Any]:
    if isinstance(exc, SkyrlTxError):
        return {"category": exc.category, "message": exc.message, "code": exc.code.value}
    return {"category": "server", "message": f"internal error: {type(exc).__name__}", "code": "internal"}


class EngineLoop:
    """Single owner of the backend. `notify(outcomes)` is told which futures just finished, and how."""

    def __init__(self, backend: Any, session_factory: sessionmaker[Session], checkpointer: Checkpointer,
                 notify: Notify = lambda outcomes: None, session_timeout_s: float = 300.0):
        self.backend = backend
        self.checkpointer = checkpointer
        self.sessions = session_factory
        self.database = bound_engine(session_factory)  # Core connections for the per-request statements
        self.notify = notify
        self.session_timeout_s = session_timeout_s
        self._sampling: dict[int, FutureRow] = {}  # backend sample id → its (detached) future
        self.order = SeqOrder(session_factory)  # per-model seq_id progress and the gaps waited on
        self.had_pending = True  # whether the last scan left requests it could not run yet
        # The oldest request the last scan found that the scan before had not (None: none new): engine/runner.py
        # counts a missed wake-up when one waited a whole idle poll interval with nobody waking the engine.
        self.last_scan_new_oldest: datetime | None = None
        self._last_pending_ids: set[str] = set()
        settings = getattr(backend, "settings", None)
        self.sampling_share = float(getattr(settings, "sampling_share", DEFAULT_SAMPLING_SHARE))
        self._decode_credit_s = 0.0  # decode time owed to samplers by the training that ran meanwhile
        self.arrived: Callable[[], bool] = lambda: False  # whether a request arrived since the last scan (run_engine)
        # Streaming samples (the OpenAI endpoint's stream: true): after each decode step, the tokens each sample
        # gained go to `report_progress([(future id, [new tokens per sample])])` where the notify callable has one.
        self._report_progress = getattr(notify, "report_progress", None)
        self._streams: dict[int, list[int]] = {}  # backend sample id → tokens already reported, per sample
        self.stats = EngineStats.attach(self)  # for /metrics (engine/stats.py)

    def expire_sessions(self) -> list[str]:
        """Sessions silent past the timeout end like finished ones: each live model gets an unload request
        (db/unload_requests.py), which runs after the model's queued work and once its samples are done, so its
        adapter slot can be reused. Returns the model ids asked to unload."""
        cutoff = datetime.now(timezone.utc).timestamp() - self.session_timeout_s
        asked = []
        with self.sessions.begin() as db:
            for session in db.scalars(select(SessionRecord).where(SessionRecord.status == SessionStatus.ACTIVE.value)):
                if session.last_heartbeat_at.timestamp() >= cutoff:
                    continue
                session.status = SessionStatus.EXPIRED.value
                asked += unload_requests.request_unloads(db, session.id)
        for model_id in asked:
            log.info("session timeout: model %s will be unloaded", model_id)
        if asked:
            self.had_pending = True  # the unload requests just stored need a scan
        self.checkpointer.expire()
        return asked

    def recover(self) -> None:
        """At start, on a fresh backend: a future left "running" by a dead engine left no trace (results and
        state changes are stored only on completion), so it runs again; live models are rebuilt from their
        completed requests (engine/replay.py). A request that was running during MAX_ATTEMPTS crashes fails
        instead, so one poisonous request cannot crash-loop the engine."""
        self.checkpointer.recover()
        with self.sessions.begin() as db:
            for f in db.scalars(select(FutureRecord).where(FutureRecord.status == FutureStatus.RUNNING.value)):
                if f.attempts >= MAX_ATTEMPTS:
                    f.status, f.completed_at = FutureStatus.FAILED.value, datetime.now(timezone.utc)
                    f.error = {"category": "server", "code": "internal", "message": f"the engine stopped "
                               f"{f.attempts} times while running this request; it will not be retried"}
                    log.error("request %s failed after %d engine crashes", _named(f), f.attempts)
                else:
                    f.status = FutureStatus.PENDING.value
                    log.info("request %s was interrupted by an engine stop; it runs again", _named(f))
        recovery_state.snapshotter(self).remove_orphans()
        replay.rebuild_models(self)

    def step(self, scan_pending: bool = True) -> bool:
        """Runs what is runnable now; returns whether anything happened. scan_pending=False only advances
        the running samples (the caller knows no new request arrived; see run_engine)."""
        pending: list[FutureRow] = []
        if scan_pending:
            with self.database.connect() as db:  # read-only Core rows, no ORM identity map
                pending = list(db.execute(future_queries.PENDING))
            new = [f.created_at for f in pending if f.id not in self._last_pending_ids]
            self.last_scan_new_oldest = min(new) if new else None
            self._last_pending_ids = {f.id for f in pending}
        ran = 0
        by_model: dict[str, list[FutureRow]] = defaultdict(list)
        creates, samples = [], []
        for f in pending:
            if f.request_type in ("create_model", "create_custom_loss"):  # no model queue: run at once
                creates.append(f)
            elif f.request_type == "sample":
                samples.append(f)
            else:
                by_model[f.model_id or ""].append(f)
        if samples:
            self._submit_samples(samples)
            ran += len(samples)
        for model_id, queue in by_model.items():
            queue.sort(key=lambda f: (f.seq_id is None, f.seq_id or 0))  # unseq'd (unload) goes last
            by_model[model_id] = self._in_order(model_id, queue)
        ran += self._run_saves(by_model)  # stores finished saves; starts new ones; a saving model's queue waits
        ran += self._run_unloads(by_model)  # first: a closed session's slots are free for the creates below
        for f in creates:
            self._run_single(f, self._create_model if f.request_type == "create_model" else self._create_custom_loss)
            ran += 1
        if self._decode_credit_s <= 0 or not self._sampling:  # else decoding is owed time: training waits
            started = time.perf_counter()
            trained = self._run_training(by_model)
            # Optim steps and other barriers at the head of their model's queue: training-side time too.
            trained += self._run_barriers([queue[0] for queue in by_model.values()
                                           if queue and queue[0].request_type not in TRAIN_TYPES])
            if trained:
                owed = (time.perf_counter() - started) * self.sampling_share / (1.0 - self.sampling_share)
                self._decode_credit_s = min(self._decode_credit_s + owed, MAX_DECODE_CREDIT_S)
            ran += trained
        if scan_pending:
            # Requests left waiting (behind a barrier that just ran, or a seq_id gap) need another scan; when
            # everything found ran, only a wake-up (a new request) does.
            self.had_pending = ran < len(pending)
        return self._decode() or ran > 0

    def _in_order(self, model_id: str, queue: list[FutureRow]) -> list[FutureRow]:
        """The part of a model's sorted queue that may run now (engine/seq_order.py); what never can is failed."""
        runnable = self.order.runnable(model_id, queue)
        if runnable.never:
            error = {"category": "user", "code": ErrorCode.CONFLICT.value,
                     "message": f"model {model_id} was unloaded (or its session finished or expired) while this "
                                f"request waited for request seq_id {runnable.missing}, which never arrived; it did "
                                "not run"}
            log.warning("model %s: %d request(s) waiting for seq_id %d failed: the model is being unloaded",
                        model_id, len(runnable.never), runnable.missing)
            self._finish_many([(f, None, error) for f in runnable.never])
        return runnable.now

    def _run_unloads(self, by_model: dict[str, list[FutureRow]]) -> int:
        """Unloads every model whose queue starts with its unload request. A model still serving samples keeps
        its unload pending (retried on a later step), so a closed session's in-flight samples complete first."""
        ran = 0
        for model_id, queue in by_model.items():
            if not queue or queue[0].request_type != "unload_model":
                continue
            try:
                self.backend.remove_model(model_id)
            except ConflictError:  # still serving samples
                continue
            except NotFoundError:  # never made it into the backend (or already gone)
                pass
            self._run_single(queue.pop(0), self._mark_unloaded)
            ran += 1
        return ran

    def _mark_unloaded(self, f: FutureRow) -> dict[str, Any]:
        with self.sessions.begin() as db:
            db.get(ModelRecord, f.model_id).status = ModelStatus.UNLOADED.value
        self.order.forget(f.model_id)
        return {"model_id": f.model_id}

    # ---- training ------------------------------------------------------------------------------
    def _run_training(self, by_model: dict[str, list[FutureRow]]) -> int:
        """The leading forward/forward_backward requests of every model run as one batched pass each; returns
        how many requests ran."""
        batch: dict[str, list[FutureRow]] = {"forward_backward": [], "forward": []}
        for queue in by_model.values():
            while queue and queue[0].request_type in TRAIN_TYPES:
                f = queue.pop(0)
                batch[f.request_type].append(f)
        ran = 0
        for kind, futures in batch.items():
            futures = self._mark_running(futures) if futures else []
            if not futures:
                continue
            ran += len(futures)
            run = self.backend.forward_backward if kind == "forward_backward" else self.backend.forward
            try:
                results = run(executor.train_requests(self.database, futures))
            except Exception:  # noqa: BLE001 - the backend validates everything before computing anything and
                # rolls back a batch that fails while computing (csrc/backend/grad_transaction.h), so a failed
                # batch changed nothing: rerun one by one to pin the error on its request.
                for f in futures:
                    self._run_single(
                        f, lambda r: executor.train_result(run(executor.train_requests(self.database, [r]))[0]),
                        already_running=True)
                continue
            self._finish_many([(f, executor.train_result(r), None) for f, r in zip(futures, results)])
        return ran

    def _run_barriers(self, barriers: list[FutureRow]) -> int:
        """One barrier of each model (different models: independent), bookkept together: one transaction marks
        them running, one stores their results, so 8 users' optim steps cost 2 commits, not 16."""
        barriers = self._mark_running(barriers) if barriers else []
        if not barriers:
            return 0
        done = []
        for f in barriers:
            try:
                done.append((f, self._barrier(f), None))
            except Exception as exc:  # noqa: BLE001 - every failure becomes the future's error
                if not isinstance(exc, SkyrlTxError):
                    log.exception("request %s (%s) failed", _named(f), f.request_type)
                done.append((f, None, _error(exc)))
        self._finish_many(done)
        return len(barriers)

    def _barrier(self, f: FutureRow) -> dict[str, Any]:
        request = f.request
        if f.request_type == "optim_step":
            metrics = self.backend.optim_step(request["model_id"], executor.optim_params(request))
            # No gradients are pending right after a step: the moment for a recovery snapshot (copied here,
            # written on a background thread; see engine/recovery_state.py). It never raises.
            recovery_state.snapshotter(self).after_optim_step(request["model_id"], f.seq_id)
            return {"metrics": metrics}
        if f.request_type == "save_weights_for_sampler":
            return self._save_for_sampler(f)
        if f.request_type in ("save_weights", "save_weights_external"):
            return {**self.checkpointer.save(request), "type": f.request_type}
        if f.request_type == "load_weights":
            return self.checkpointer.load_into(request["model_id"], request["path"], bool(request["optimizer"]))
        raise UnimplementedError(f"{f.request_type}: not supported by this server yet")

    def _save_for_sampler(self, f: FutureRow) -> dict[str, Any]:
        request = f.request
        snapshot_id = request.get("sampling_session_id") or request["path"]
        if not request.get("sampling_session_id"):  # named: on disk (PEFT / HF format) and in memory
            result = self.checkpointer.save(request)
            self.checkpointer.remove_snapshot(snapshot_id)  # an overwrite: the old frozen weights are stale
            self.checkpointer.snapshot(request["model_id"], snapshot_id)
            with self.sessions() as db:
                snapshots.release_old_snapshots(self.backend, db, request["model_id"], self.checkpointer)
            return result
        self.checkpointer.snapshot(request["model_id"], snapshot_id)
        with self.sessions.begin() as db:
            model = db.get(ModelRecord, request["model_id"])
            inflight = bool(request.get("inflight"))
            db.add(SamplingSessionRecord(id=snapshot_id, session_id=model.session_id, base_model=model.base_model,
                                         model_id=model.id, snapshot_id=snapshot_id, inflight=inflight))
            if inflight:  # every inflight client of the model samples this snapshot from now on
                model.inflight_snapshot_id = snapshot_id
            db.flush()
            snapshots.release_old_snapshots(self.backend, db, model.id, self.checkpointer)
        return {"sampling_session_id": snapshot_id}

    # ---- background saves (engine/background_saves.py) ---------------------------------------------
    # A save that writes files takes host copies of the model's state on this thread, then serialises, writes and
    # uploads them on the save worker, so other models' training and all sampling go on meanwhile. The saving
    # model's later requests wait until the save is stored, although the copy already makes them safe for the
    # files: were they to run first, an engine crash during the write would rerun the save after them on
    # restart (replay rebuilds completed requests only) and save newer state under the old name.
    def _run_saves(self, by_model: dict[str, list[FutureRow]]) -> int:
        """Stores the saves that finished writing, then starts the file saves at the head of a model's queue.
        Returns how many queued requests it started."""
        self._store_finished_saves()
        started = 0
        for model_id, queue in by_model.items():
            if self.checkpointer.saves.busy(model_id):
                queue.clear()  # this model waits for its save
                continue
            first = next((i for i, f in enumerate(queue) if _writes_files(f)), None)
            if first is None:
                continue
            if first > 0:  # what precedes the save runs in this step; the save starts in the next one
                del queue[first:]
                continue
            f = queue.pop(0)
            queue.clear()
            self._start_save(f)
            started += 1
        return started

    def _start_save(self, f: FutureRow) -> None:
        if not self._mark_running([f]):
            return
        request = f.request
        try:
            pending = self.checkpointer.begin_save(request)
            if f.request_type == "save_weights_for_sampler":  # named: also frozen in memory, from this moment
                snapshot_id = request["path"]
                self.checkpointer.remove_snapshot(snapshot_id)  # an overwrite: the old frozen weights are stale
                self.checkpointer.snapshot(request["model_id"], snapshot_id)
                with self.sessions() as db:
                    snapshots.release_old_snapshots(self.backend, db, request["model_id"], self.checkpointer)
        except Exception as exc:  # noqa: BLE001 - every failure becomes the future's error
            if not isinstance(exc, SkyrlTxError):
                log.exception("request %s (%s) failed", _named(f), f.request_type)
            self._finish(f, error=_error(exc))
            return
        self.checkpointer.saves.submit(f.model_id or request["model_id"], (f, pending),
                                       lambda: self.checkpointer.write(pending))

    def _store_finished_saves(self) -> int:
        """The futures of saves whose files are completely written (or failed) complete now, in one batch."""
        done = []
        for (f, pending), size, error in self.checkpointer.saves.finished():
            try:
                result = self.checkpointer.end_save(pending, size, error)
            except Exception as exc:  # noqa: BLE001
                if f.request_type == "save_weights_for_sampler":
                    try:  # not saved: its path must not sample weights that were never listed
                        self.checkpointer.remove_snapshot(str(pending.path))
                    except ConflictError:
                        pass
                done.append((f, None, _error(exc)))
                continue
            if f.request_type != "save_weights_for_sampler":
                result = {**result, "type": f.request_type}
            done.append((f, result, None))
        if done:
            self._finish_many(done)
        return len(done)

    def _create_custom_loss(self, f: FutureRow) -> dict[str, Any]:
        """Rebuilds the graph from the core's allow-list once, so a refused operation fails create_custom_loss (a
        user error naming the node) rather than every forward_backward that would use it."""
        self.backend.check_custom_loss(executor.custom_loss_graph(f.id, f.request))
        return {"loss_id": f.id, "type": "create_custom_loss"}

    def _create_model(self, f: FutureRow) -> dict[str, Any]:
        model_id = f.request["model_id"]
        with self.sessions() as db:
            if db.get(ModelRecord, model_id).status == ModelStatus.UNLOADED.value:  # its session ended first
                raise ConflictError(f"create_model: model {model_id} was unloaded (its session finished or "
                                    "expired) before it was created; create it in a new session")
        try:
            result = self.create_in_backend(f.request)
        except Exception:
            with self.sessions.begin() as db:
                db.get(ModelRecord, model_id).status = ModelStatus.FAILED.value
            raise
        with self.sessions.begin() as db:
            db.get(ModelRecord, model_id).status = ModelStatus.READY.value
        return result

    def create_in_backend(self, r: dict[str, Any]) -> dict[str, Any]:
        """Creates (and, for create-from-checkpoint, loads) a model. An unseeded LoRA gets a random seed,
        recorded on the model so a rebuild after an engine restart creates the very same adapter."""
        with self.sessions.begin() as db:
            model = db.get(ModelRecord, r["model_id"])
            seed = r.get("seed")
            if seed is None:
                seed = (model.lora_config or {}).get("seed")
            if seed is None:  # the SDK's "random seed"
                seed = random.getrandbits(63)
                model.lora_config = {**(model.lora_config or {}), "seed": seed}
        self.backend.create_model(r["model_id"], lora_rank=r["lora_rank"], alpha=executor.LORA_ALPHA, seed=seed,
                                  train_attn=r["train_attn"], train_mlp=r["train_mlp"],
                                  train_unembed=r["train_unembed"], optimizer=r.get("optimizer", "adamw"))
        if not r.get("load"):
            return {"model_id": r["model_id"]}
        try:  # create_training_client_from_state: the model starts from a checkpoint
            return self.checkpointer.load_into(r["model_id"], r["load"]["path"], bool(r["load"]["optimizer"]),
                                               fresh=True)
        except Exception:
            self.backend.remove_model(r["model_id"])
            raise

    # ---- sampling ------------------------------------------------------------------------------
    def _submit_samples(self, futures: list[FutureRow]) -> None:
        """The scan's new samples join the running batch; marked running in one transaction."""
        for f in self._mark_running(futures):
            self._submit_sample(f)

    def _submit_sample(self, f: FutureRow) -> None:
        try:
            weights_id = f.request.get("weights_id", "")
            if ":sample:" in weights_id and not self.checkpointer.has_snapshot(weights_id):
                raise snapshots.released_error(weights_id)
            self.checkpointer.ensure_snapshot(weights_id)
            backend_id = self.backend.submit_sample(executor.sample_request(f.request))
            self._sampling[backend_id] = f
            if f.request.get("stream") and self._report_progress is not None and hasattr(self.backend,
                                                                                          "sample_progress"):
                self._streams[backend_id] = []
        except Exception as exc:  # noqa: BLE001 - stored on the future, never raised into the loop
            self._finish(f, error=_error(exc))

    def _decode(self) -> bool:
        """One decode step, then more while decoding is owed device time by the training passes before it (the
        sampling_share), in slices of at most DECODE_SLICE_S so that new samples join the batch between them."""
        if not self._sampling:
            self._decode_credit_s = 0.0  # nothing to decode: training owes nobody
            return False
        deadline = time.perf_counter() + DECODE_SLICE_S
        while True:
            started = time.perf_counter()
            self._advance_sampling()
            self._decode_credit_s = max(self._decode_credit_s - (time.perf_counter() - started), 0.0)
            if (self._decode_credit_s <= 0 or not self._sampling or time.perf_counter() >= deadline
                    or self.arrived()):  # a new request (often the next sample of a client just served): scan
                return True

    def _advance_sampling(self) -> bool:
        if not self._sampling:
            return False
        done = []
        for backend_id, result in self.backend.sample_step():
            self._streams.pop(backend_id, None)
            f = self._sampling.pop(backend_id, None)
            if f is not None and getattr(result, "error", None) is not None:  # types.FailedSample
                done.append((f, None, _error(result.error)))
            elif f is not None:
                done.append((f, executor.sample_result(result, f.request), None))
        if done:  # every sample that finished in this step: one transaction, one notification
            self._finish_many(done)
        if self._streams:
            self._report_stream_progress()
        return True

    def _report_stream_progress(self) -> None:
        """The tokens each streaming sample gained in this step (its final result still comes as its outcome)."""
        items = []
        for backend_id, so_far in self.backend.sample_progress(list(self._streams)).items():
            sent = self._streams[backend_id]
            sent.extend([0] * (len(so_far) - len(sent)))
            new = [tokens[already:] for tokens, already in zip(so_far, sent)]
            if any(new):
                items.append((self._sampling[backend_id].id, new))
                self._streams[backend_id] = [len(tokens) for tokens in so_far]
        if items:
            self._report_progress(items)

    # ---- bookkeeping ---------------------------------------------------------------------------
    def _run_single(self, f: FutureRow, fn: Callable[[FutureRow], dict[str, Any]],
                    already_running: bool = False) -> None:
        if not already_running and not self._mark_running([f]):
            return
        try:
            result = fn(f)
        except Exception as exc:  # noqa: BLE001 - every failure becomes the future's error
            if not isinstance(exc, SkyrlTxError):
                log.exception("request %s (%s) failed", _named(f), f.request_type)
            self._finish(f, error=_error(exc))
            return
        self._finish(f, result=result)

    # Bookkeeping writes are prebuilt Core UPDATEs (db/future_queries.py) on plain connections: besides the
    # compute itself they are the engine's per-request cost (see `python -m skyrl_tx.bench api`).
    def _mark_running(self, futures: list[FutureRow]) -> list[FutureRow]:
        """Claims `futures` (pending -> running) and returns those it claimed: the claim is conditional, so a request
        cancelled since the scan (api cancel_future, a conditional UPDATE too) stays failed and never runs. Its
        seq_id is taken all the same: SeqOrder counts a failed request as done."""
        now = datetime.now(timezone.utc)
        with self.database.begin() as db:
            claimed = db.execute(future_queries.MARK_RUNNING, [{"id_": f.id, "now": now} for f in futures]).rowcount
            # One statement, or a driver that sums an executemany's counts: the count says whether all were claimed.
            if claimed != len(futures) or not (len(futures) == 1 or db.dialect.supports_sane_multi_rowcount):
                ids = set(db.execute(future_queries.CLAIMED, {"ids": [f.id for f in futures]}).scalars())
                for f in futures:
                    if f.id not in ids:
                        log.info("request %s was cancelled before it ran: it does not run", _named(f))
                futures = [f for f in futures if f.id in ids]
        self.stats.started(futures, now)
        return futures

    def _finish(self, f: FutureRow, *, result: Any = None, error: dict[str, Any] | None = None) -> None:
        self._finish_many([(f, result, error)])

    def _finish_many(self, done: list[tuple[FutureRow, Any, dict[str, Any] | None]]) -> None:
        """Stores results (or errors) in one transaction, then tells the waiting pollers what was stored."""
        now = datetime.now(timezone.utc)
        outcomes = []
        for f, result, error in done:
            if f.model_id and f.seq_id is not None:
                self.order.finished(f.model_id, f.seq_id)
            status = (FutureStatus.FAILED if error else FutureStatus.COMPLETED).value
            outcomes.append(FutureOutcome(f.id, status, f.request_type, result, error, *self.stats.timings(f, now)))
        with self.database.begin() as db:
            db.execute(future_queries.FINISH, future_queries.finish_params(outcomes, now))
        self.notify(outcomes)
