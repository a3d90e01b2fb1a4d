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

from skyrl_tx.db import future_queries
from skyrl_tx.db.future_queries import FutureOutcome, FutureRow, Notify
from skyrl_tx.db.session import bound_engine
from skyrl_tx.db.models import (FutureRecord, FutureStatus, ModelRecord, ModelStatus, SamplingSessionRecord,
                                SessionRecord, SessionStatus)
from skyrl_tx.engine import executor, replay, snapshots
from skyrl_tx.engine.checkpointing import Checkpointer
from skyrl_tx.errors import ConflictError, NotFoundError, SkyrlTxError, UnimplementedError

log = logging.getLogger("skyrl_tx.engine")

TRAIN_TYPES = ("forward_backward", "forward")  # batched across models; everything else is a per-model barrier
# A model's requests run in seq_id order. A missing seq_id is waited for this long: a request the API
# rejected at the edge consumed its seq_id without ever being stored, and must not stall the model.
GAP_WAIT_S = 5.0
MAX_ATTEMPTS = 3  # engine crashes a single request may cause before it is failed instead of retried


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
        self._last_seq: dict[str, int] = {}  # model id → highest seq_id executed
        self.had_pending = True  # whether the last scan left requests it could not run yet

    def expire_sessions(self) -> list[str]:
        """Sessions silent past the timeout lose their models, so their adapter slots can be reused.
        Returns the unloaded model ids. A model still serving samples is retried on the next sweep."""
        cutoff = datetime.now(timezone.utc).timestamp() - self.session_timeout_s
        unloaded = []
        with self.sessions.begin() as db:
            for session in db.scalars(select(SessionRecord).where(SessionRecord.status == SessionStatus.ACTIVE.value)):
                if session.last_heartbeat_at.timestamp() >= cutoff:
                    continue
                models = db.scalars(select(ModelRecord).where(ModelRecord.session_id == session.id,
                                                             ModelRecord.status == ModelStatus.READY.value))
                busy = False
                for model in models:
                    try:
                        self.backend.remove_model(model.id)
                    except ConflictError:  # still serving samples: unload on a later sweep
                        busy = True
                        continue
                    except NotFoundError:  # never made it into the backend
                        pass
                    model.status = ModelStatus.UNLOADED.value
                    unloaded.append(model.id)
                if not busy:
                    session.status = SessionStatus.EXPIRED.value
        for model_id in unloaded:
            log.info("session timeout: unloaded model %s", model_id)
        self.checkpointer.expire()
        return unloaded

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
                    log.error("request %s failed after %d engine crashes", f.id, f.attempts)
                else:
                    f.status = FutureStatus.PENDING.value
                    log.info("request %s was interrupted by an engine stop; it runs again", f.id)
        replay.rebuild_models(self)

    def step(self, scan_pending: bool = True) -> bool:
        """Runs what is runnable now; returns whether anything happened. scan_pending=False only advances
        the running samples (the caller knows no new request arrived; see run_engine)."""
        pending: list[FutureRow] = []
        if scan_pending:
            with self.database.connect() as db:  # read-only Core rows, no ORM identity map
                pending = list(db.execute(future_queries.PENDING))
        ran = 0
        by_model: dict[str, list[FutureRow]] = defaultdict(list)
        for f in pending:
            if f.request_type == "create_model":
                self._run_single(f, self._create_model)
                ran += 1
            elif f.request_type == "sample":
                self._submit_sample(f)
                ran += 1
            else:
                by_model[f.model_id or ""].append(f)
        for model_id, queue in by_model.items():
            queue.sort(key=lambda f: (f.seq_id is None, f.seq_id or 0))  # unseq'd (unload) goes last
            by_model[model_id] = self._in_order(model_id, queue)
        ran += self._run_training(by_model)
        for queue in by_model.values():
            barrier = next((f for f in queue if f.request_type not in TRAIN_TYPES), None)
            if barrier is not None and queue[0] is barrier:
                self._run_single(barrier, self._barrier)
                ran += 1
        if scan_pending:
            # Requests left waiting (behind a barrier that just ran, or a seq_id gap) need another scan; when
            # everything found ran, only a wake-up (a new request) does.
            self.had_pending = ran < len(pending)
        return self._advance_sampling() or ran > 0

    def _in_order(self, model_id: str, queue: list[FutureRow]) -> list[FutureRow]:
        """The prefix of a model's sorted queue that may run now: no seq_id before it is still missing."""
        last = self._last_seq.get(model_id)
        if last is None:
            with self.sessions() as db:
                done = db.scalars(select(FutureRecord.seq_id).where(
                    FutureRecord.model_id == model_id, FutureRecord.seq_id.is_not(None),
                    FutureRecord.status.in_([FutureStatus.COMPLETED.value, FutureStatus.FAILED.value]))).all()
            last = self._last_seq[model_id] = max(done, default=0)
        runnable = []
        now = datetime.now(timezone.utc)
        for f in queue:
            if f.seq_id is not None and f.seq_id > last + 1 and (now - f.created_at).total_seconds() < GAP_WAIT_S:
                break  # an earlier request of this model has not arrived yet
            runnable.append(f)
            if f.seq_id is not None:
                last = f.seq_id
        return runnable

    # ---- training ------------------------------------------------------------------------------
    def _run_training(self, by_model: dict[str, list[FutureRow]]) -> int:
        """The leading forward/forward_backward requests of every model run as one batched pass each; returns
        how many requests ran."""
        batch: dict[str, list[FutureRow]] = {"forward_backward": [], "forward": []}
        for queue in by_model.values():
            while queue and queue[0].request_type in TRAIN_TYPES:
                f = queue.pop(0)
                batch[f.request_type].append(f)
        for kind, futures in batch.items():
            if not futures:
                continue
            self._mark_running(futures)
            run = self.backend.forward_backward if kind == "forward_backward" else self.backend.forward
            try:
                results = run([executor.train_request(f.request) for f in futures])
            except Exception:  # noqa: BLE001 - the backend validates everything before computing anything,
                # so a failed batch changed nothing: rerun one by one to pin the error on its request.
                for f in futures:
                    self._run_single(f, lambda r: executor.train_result(run([executor.train_request(r.request)])[0]),
                                     already_running=True)
                continue
            self._finish_many([(f, executor.train_result(r), None) for f, r in zip(futures, results)])
        return sum(len(futures) for futures in batch.values())

    def _barrier(self, f: FutureRow) -> dict[str, Any]:
        request = f.request
        if f.request_type == "optim_step":
            return {"metrics": self.backend.optim_step(request["model_id"], executor.adam_params(request))}
        if f.request_type == "save_weights_for_sampler":
            return self._save_for_sampler(f)
        if f.request_type in ("save_weights", "save_weights_external"):
            return {**self.checkpointer.save(request), "type": f.request_type}
        if f.request_type == "load_weights":
            return self.checkpointer.load_into(request["model_id"], request["path"], bool(request["optimizer"]))
        if f.request_type == "unload_model":
            self.backend.remove_model(request["model_id"])
            with self.sessions.begin() as db:
                db.get(ModelRecord, request["model_id"]).status = ModelStatus.UNLOADED.value
            return {"model_id": request["model_id"]}
        raise UnimplementedError(f"{f.request_type}: not supported by this server yet")

    def _save_for_sampler(self, f: FutureRow) -> dict[str, Any]:
        request = f.request
        snapshot_id = request.get("sampling_session_id") or request["path"]
        if not request.get("sampling_session_id"):  # named: on disk (PEFT / HF format) and in memory
            result = self.checkpointer.save(request)
            if self.backend.has_snapshot(snapshot_id):  # an overwrite: the old frozen weights are stale
                self.backend.remove_snapshot(snapshot_id)
            self.backend.snapshot(request["model_id"], snapshot_id)
            with self.sessions() as db:
                snapshots.release_old_snapshots(self.backend, db, request["model_id"])
            return result
        self.backend.snapshot(request["model_id"], snapshot_id)
        with self.sessions.begin() as db:
            model = db.get(ModelRecord, request["model_id"])
            db.add(SamplingSessionRecord(id=snapshot_id, session_id=model.session_id, base_model=model.base_model,
                                         model_id=model.id, snapshot_id=snapshot_id))
            db.flush()
            snapshots.release_old_snapshots(self.backend, db, model.id)
        return {"sampling_session_id": snapshot_id}

    def _create_model(self, f: FutureRow) -> dict[str, Any]:
        model_id = f.request["model_id"]
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
                                  train_unembed=r["train_unembed"])
        if not r.get("load"):
            return {"model_id": r["model_id"]}
        try:  # create_training_client_from_state: the model starts from a checkpoint
            return self.checkpointer.load_into(r["model_id"], r["load"]["path"], bool(r["load"]["optimizer"]),
                                               fresh=True)
        except Exception:
            self.backend.remove_model(r["model_id"])
            raise

    # ---- sampling ------------------------------------------------------------------------------
    def _submit_sample(self, f: FutureRow) -> None:
        self._mark_running([f])
        try:
            weights_id = f.request.get("weights_id", "")
            if ":sample:" in weights_id and not self.backend.has_snapshot(weights_id):
                raise snapshots.released_error(weights_id)
            self.checkpointer.ensure_snapshot(weights_id)
            self._sampling[self.backend.submit_sample(executor.sample_request(f.request))] = f
        except Exception as exc:  # noqa: BLE001 - stored on the future, never raised into the loop
            self._finish(f, error=_error(exc))

    def _advance_sampling(self) -> bool:
        if not self._sampling:
            return False
        done = []
        for backend_id, result in self.backend.sample_step():
            f = self._sampling.pop(backend_id, None)
            if f is not None:
                done.append((f, executor.sample_result(result), None))
        if done:  # every sample that finished in this step: one transaction, one notification
            self._finish_many(done)
        return True

    # ---- bookkeeping ---------------------------------------------------------------------------
    def _run_single(self, f: FutureRow, fn: Callable[[FutureRow], dict[str, Any]],
                    already_running: bool = False) -> None:
        if not already_running:
            self._mark_running([f])
        try:
            result = fn(f)
        except Exception as exc:  # noqa: BLE001 - every failure becomes the future's error
            if not isinstance(exc, SkyrlTxError):
                log.exception("request %s (%s) failed", f.id, f.request_type)
            self._finish(f, error=_error(exc))
            return
        self._finish(f, result=result)

    # Bookkeeping writes are prebuilt Core UPDATEs (db/future_queries.py) on plain connections: besides the
    # compute itself they are the engine's per-request cost (see `python -m skyrl_tx.bench api`).
    def _mark_running(self, futures: list[FutureRow]) -> None:
        now = datetime.now(timezone.utc)
        with self.database.begin() as db:
            db.execute(future_queries.MARK_RUNNING, [{"id_": f.id, "now": now} for f in futures])

    def _finish(self, f: FutureRow, *, result: Any = None, error: dict[str, Any] | None = None) -> None:
        self._finish_many([(f, result, error)])

    def _finish_many(self, done: list[tuple[FutureRow, Any, dict[str, Any] | None]]) -> None:
        """Stores results (or errors) in one transaction, then tells the waiting pollers what was stored."""
        now = datetime.now(timezone.utc)
        outcomes = []
        for f, result, error in done:
            if f.model_id and f.seq_id is not None:
                self._last_seq[f.model_id] = max(self._last_seq.get(f.model_id, 0), f.seq_id)
            status = (FutureStatus.FAILED if error else FutureStatus.COMPLETED).value
            outcomes.append(FutureOutcome(f.id, status, f.request_type, result, error))
        with self.database.begin() as db:
            db.execute(future_queries.FINISH, [{"id_": o.id, "status_": o.status, "result_": o.result,
                                                "error_": o.error, "now": now} for o in outcomes])
        self.notify(outcomes)
