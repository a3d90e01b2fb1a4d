"""EngineLoop: one step = claim pending futures → batch per model in seq_id order → run on the backend → store."""

from __future__ import annotations

import logging
import random
from collections import defaultdict
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from skyrl_tx.db import future_queries, unload_requests
from skyrl_tx.db.future_queries import FutureOutcome, FutureRow, Notify
from skyrl_tx.db.session import bound_engine
from skyrl_tx.db.models import (FutureRecord, FutureStatus, ModelRecord, ModelStatus, SessionRecord,
                                SessionStatus)
from skyrl_tx.engine import executor, recovery_state, replay
from skyrl_tx.engine.checkpointing import Checkpointer
from skyrl_tx.engine.decode_share import DEFAULT_SAMPLING_SHARE, DecodeShare
from skyrl_tx.engine.outcomes import error as _error, named as _named
from skyrl_tx.engine.sample_runs import SampleRuns
from skyrl_tx.engine.save_steps import SaveSteps
from skyrl_tx.engine.seq_order import SeqOrder
from skyrl_tx.engine.stats import EngineStats
from skyrl_tx.errors import ConflictError, ErrorCode, NotFoundError, SkyrlTxError, UnimplementedError

log = logging.getLogger("skyrl_tx.engine")

TRAIN_TYPES = ("forward_backward", "forward")  # batched across models; everything else is a per-model barrier
MAX_ATTEMPTS = 3  # engine crashes a single request may cause before it is failed instead of retried


class EngineLoop(SaveSteps):
    """Single owner of the backend. `notify(outcomes)` is told which futures just finished, and how."""

    def __init__(self, backend: Any, session_factory: sessionmaker[Session], checkpointer: Checkpointer,
                 notify: Notify = lambda outcomes: None, session_timeout_s: float = 300.0):
        self.backend = backend
        self.checkpointer = checkpointer
        self.sessions = session_factory
        self.database = bound_engine(session_factory)  # Core connections for the per-request statements
        self.notify = notify
        self.session_timeout_s = session_timeout_s
        self.order = SeqOrder(session_factory)  # per-model seq_id progress and the gaps waited on
        self.had_pending = True  # whether the last scan left requests it could not run yet
        # The oldest request the last scan found that the scan before had not (None: none new): engine/runner.py
        # counts a missed wake-up when one waited a whole idle poll interval with nobody waking the engine.
        self.last_scan_new_oldest: datetime | None = None
        self._last_pending_ids: set[str] = set()
        settings = getattr(backend, "settings", None)
        # The device-time split between training and decoding (engine/decode_share.py)
        self.share = DecodeShare(float(getattr(settings, "sampling_share", DEFAULT_SAMPLING_SHARE)))
        self.arrived: Callable[[], bool] = lambda: False  # whether a request arrived since the last scan (run_engine)
        # The running samples (engine/sample_runs.py); streaming ones report their tokens to the notify callable's
        # report_progress where it has one.
        self._sampling = SampleRuns(backend, checkpointer, self._finish_many, _error,
                                    getattr(notify, "report_progress", None))
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
        recovery_state.snapshotter(self).hold_copying(by_model)  # a model whose recovery copy runs waits
        ran += self._run_unloads(by_model)  # first: a closed session's slots are free for the creates below
        for f in creates:
            self._run_single(f, self._create_model if f.request_type == "create_model" else self._create_custom_loss)
            ran += 1
        if self.share.training_may_run(bool(self._sampling)):  # else decoding is owed time: training waits
            # Optim steps and other barriers at the head of their model's queue: training-side time too.
            ran += self.share.train(lambda: self._run_training(by_model) + self._run_barriers(
                [queue[0] for queue in by_model.values() if queue and queue[0].request_type not in TRAIN_TYPES]))
        if scan_pending:
            # Requests left waiting (behind a barrier that just ran, or a seq_id gap) need another scan; when
            # everything found ran, only a wake-up (a new request) does.
            self.had_pending = ran < len(pending)
        return self.share.decode(self._sampling.advance, lambda: bool(self._sampling), self.arrived) or ran > 0

    @property
    def sampling_share(self) -> float:
        return self.share.share

    @sampling_share.setter
    def sampling_share(self, share: float) -> None:
        self.share.share = share

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

    # ---- sampling (engine/sample_runs.py) ----------------------------------------------------------
    def _submit_samples(self, futures: list[FutureRow]) -> None:
        """The scan's new samples join the running batch; marked running in one transaction."""
        for f in self._mark_running(futures):
            self._sampling.submit(f)

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
