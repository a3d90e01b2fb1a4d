"""Stores an accepted request as a pending future, idempotently, and wakes the engine; stores a rejected one of a
model's sequence as a failed future (its seq_id is consumed)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any

from fastapi import Request
from sqlalchemy import Connection, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from skyrl_tx.api.body_ids import forward_backward_ids
from skyrl_tx.api.ownership import require_owned_model
from skyrl_tx.api.principal import caller_of
from skyrl_tx.api.request_ids import REQUEST_ID
from skyrl_tx.api.trace.ring import record_submitted
from skyrl_tx.api.validation import SEQ_ID_MAX
from skyrl_tx.db import audit, future_queries
from skyrl_tx.db.models import FutureStatus, ModelRecord, ModelStatus, request_hash
from skyrl_tx.errors import ConflictError, NotFoundError, SkyrlTxError


def submit_future(request: Request, db: Session | Connection, *, future_id: str, request_type: str,
                  body: dict[str, Any], model_id: str | None = None, seq_id: int | None = None,
                  session_id: str | None = None, extra_rows: tuple[Any, ...] = (),
                  binary_body: bytes | None = None, completion_queue: str | None = None) -> str:
    """Same id and same body → the existing future (a retry runs once); same id, other body → 409.
    `body` is the JSON request; `binary_body` the bulk of it, stored and hashed as bytes (a forward_backward's
    protobuf). `extra_rows` (ORM records stored in the same transaction) need a Session. `completion_queue`: a
    sample's (db/completion_queues.py), which retrieve_futures polls."""
    digest = request_hash(body, binary_body)
    row = {"id": future_id, "session_id": session_id, "model_id": model_id, "request_type": request_type,
           "seq_id": seq_id, "request": body, "request_body": binary_body, "request_hash": digest,
           "request_id": REQUEST_ID.get(),  # not hashed: a retry carries another request id
           "completion_queue": completion_queue}  # not hashed: it follows from the id
    try:
        if extra_rows:
            assert isinstance(db, Session), "extra_rows are ORM records: submit them with a Session"
            db.add_all(extra_rows)
            db.flush()
        db.execute(future_queries.INSERT_FUTURE, row)
        _audit(request, db, future_id, request_type, body, extra_rows)
        db.commit()
    except IntegrityError:  # the id exists: a retry (or a concurrent one that won the race)
        db.rollback()
        stored = db.execute(future_queries.REQUEST_HASH, {"id_": future_id}).scalar_one_or_none()
        if stored is None:
            raise
        if stored != digest:
            raise ConflictError(f"{request_type}: request {future_id} was already submitted with a different body; "
                                "use a new seq_id for a new request") from None
    request.app.state.wake_engine()
    request.state.future_id = future_id  # named by the access-log line (api/request_ids.py)
    record_submitted(request.app, request.scope["state"], future_id)  # its arrival, in memory (api/trace/ring.py)
    return future_id


# Accepted requests that the audit log records (GET /api/v1/audit), with their event; a checkpoint save only when it
# names a checkpoint (not an ephemeral sampler snapshot).
AUDITED = {"create_model": "model_create", "unload_model": "model_unload", "save_weights": "checkpoint_save",
           "save_weights_external": "checkpoint_save", "save_weights_for_sampler": "checkpoint_save"}


def _audit(request: Request, db: Session | Connection, future_id: str, request_type: str, body: dict[str, Any],
           extra_rows: tuple[Any, ...]) -> None:
    """The audit entry of an accepted request, in its transaction: a retry (same id) rolls it back with the insert."""
    event = AUDITED.get(request_type)
    if event is None or (event == "checkpoint_save" and "path" not in body):
        return
    model_id = body["model_id"]
    created = next((r for r in extra_rows if isinstance(r, ModelRecord)), None)
    owner = created.owner_key_id if created is not None else db.execute(
        select(ModelRecord.owner_key_id).where(ModelRecord.id == model_id)).scalar_one_or_none()
    who = caller_of(request)
    details = {"model_id": model_id, "request_type": request_type, "future_id": future_id}
    if "path" in body:
        details["tinker_path"] = body["path"]
    audit.record(db, event, actor=who.key_id if who else None, owner=owner, resource=body.get("path", model_id),
                 details=details, request_id=REQUEST_ID.get())


def record_rejected(request: Request, db: Session | Connection, *, model_id: str, seq_id: int, request_type: str,
                    error: SkyrlTxError) -> None:
    """A request rejected at the edge (a 400) after its model and seq_id are known still consumes that seq_id: it is
    stored as a failed future with the 400's message, so the engine's per-model order never waits on a gap for it.
    Idempotent: if the id (or the model's seq_id) is taken already (a retry, or an accepted request) nothing
    changes. The caller has checked that the model exists (futures.model_id is a foreign key)."""
    now = datetime.now(timezone.utc)
    row = {"id": f"{model_id}:{seq_id}", "session_id": None, "model_id": model_id, "request_type": request_type,
           "seq_id": seq_id, "request": {"model_id": model_id, "rejected": True},
           "request_hash": request_hash({"rejected": error.message}), "status": FutureStatus.FAILED.value,
           "error": {"category": "user", "message": error.message, "code": error.code.value},
           "created_at": now, "completed_at": now}
    try:
        db.execute(future_queries.INSERT_FUTURE, row)
        db.commit()
    except IntegrityError:  # already stored: this rejection was recorded before, or the seq_id ran
        db.rollback()
        return
    request.app.state.wake_engine()  # a model waiting for this seq_id may go on


@contextmanager
def consumes_seq_id(request: Request, db: Session | Connection, *, model_id: str, seq_id: int,
                    request_type: str) -> Iterator[None]:
    """Around a route's checks of a request for an existing model with a valid seq_id: a user error (4xx) raised
    inside is recorded (record_rejected) and re-raised, so the client still gets its 4xx."""
    try:
        yield
    except SkyrlTxError as exc:
        if 400 <= exc.http_status < 500:
            record_rejected(request, db, model_id=model_id, seq_id=seq_id, request_type=request_type, error=exc)
        raise


# JSON routes whose requests take a seq_id of their model (forward_backward is protobuf: its route checks its own).
SEQUENCED_ROUTES = {f"/api/v1/{name}": name for name in ("optim_step", "save_weights", "save_weights_external",
                                                          "save_weights_for_sampler", "load_weights")}


def record_invalid_body(request: Request, body: Any, error: SkyrlTxError) -> None:
    """A sequenced request whose JSON failed schema validation (before its route ran) still consumes its seq_id,
    where the body names an existing model and a valid seq_id. Runs in a worker thread (it uses the database)."""
    request_type = SEQUENCED_ROUTES.get(request.url.path)
    if request_type is None or not isinstance(body, dict) or body.get("session_id") is not None:
        return
    model_id, seq_id = body.get("model_id"), body.get("seq_id")
    if not isinstance(model_id, str) or type(seq_id) is not int or not 0 <= seq_id <= SEQ_ID_MAX:
        return
    with request.app.state.database.connect() as db:
        try:
            require_owned_model(db, model_id, caller_of(request))  # never another key's sequence
        except NotFoundError:
            return
        record_rejected(request, db, model_id=model_id, seq_id=seq_id, request_type=request_type, error=error)


def record_unusable_body(request: Request, body: bytes, encoding: str | None, error: SkyrlTxError) -> None:
    """A forward_backward body refused whole (over the size limit, undecodable further on, a chunk type this server
    does not take) still consumes its seq_id, where its first fields name a live model and a valid seq_id. Runs in
    a worker thread (it uses the database)."""
    ids = forward_backward_ids(body, encoding)
    if ids is None or not 0 <= ids[1] <= SEQ_ID_MAX:
        return
    model_id, seq_id = ids
    with request.app.state.database.connect() as db:
        try:
            require_owned_model(db, model_id, caller_of(request))  # never another key's sequence
        except NotFoundError:
            return
        record_rejected(request, db, model_id=model_id, seq_id=seq_id, request_type="forward_backward", error=error)


def _model_not_found(model_id: str) -> NotFoundError:
    return NotFoundError(f"model {model_id!r} not found; create it with create_model (or a training client) first")


def require_model(db: Session | Connection, model_id: str) -> None:
    """NotFoundError unless the model exists and is not unloaded (reads its status only: the hot-path check)."""
    status = db.execute(future_queries.MODEL_STATUS, {"id_": model_id}).scalar_one_or_none()
    if status is None or status == ModelStatus.UNLOADED.value:
        raise _model_not_found(model_id)


def live_model(db: Session, model_id: str) -> ModelRecord:
    """The model's record, with require_model's NotFoundError when it is missing or unloaded."""
    model = db.get(ModelRecord, model_id)
    if model is None or model.status == ModelStatus.UNLOADED.value:
        raise _model_not_found(model_id)
    return model
