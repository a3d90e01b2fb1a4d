"""Stores an accepted request as a pending future, idempotently, and wakes the engine."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from sqlalchemy import Connection
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from skyrl_tx.db import future_queries
from skyrl_tx.db.models import ModelRecord, ModelStatus, request_hash
from skyrl_tx.errors import ConflictError, NotFoundError


def submit_future(request: Request, db: Session | Connection, *, future_id: str, request_type: str,
                  body: dict[str, Any], model_id: str | None = None, seq_id: int | None = None,
                  session_id: str | None = None, extra_rows: tuple[Any, ...] = ()) -> str:
    """Same id and same body → the existing future (a retry runs once); same id, other body → 409.
    `extra_rows` (ORM records stored in the same transaction) need a Session."""
    digest = request_hash(body)
    row = {"id": future_id, "session_id": session_id, "model_id": model_id, "request_type": request_type,
           "seq_id": seq_id, "request": body, "request_hash": digest}
    try:
        if extra_rows:
            assert isinstance(db, Session), "extra_rows are ORM records: submit them with a Session"
            db.add_all(extra_rows)
            db.flush()
        db.execute(future_queries.INSERT_FUTURE, row)
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
    return future_id


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
