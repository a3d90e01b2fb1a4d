"""Stores an accepted request as a pending future, idempotently, and wakes the engine."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from skyrl_tx.db.models import FutureRecord, ModelRecord, ModelStatus, request_hash
from skyrl_tx.errors import ConflictError, NotFoundError


def submit_future(request: Request, db: Session, *, future_id: str, request_type: str, body: dict[str, Any],
                  model_id: str | None = None, seq_id: int | None = None, session_id: str | None = None,
                  extra_rows: tuple[Any, ...] = ()) -> str:
    """Same id and same body → the existing future (a retry runs once); same id, other body → 409."""
    digest = request_hash(body)
    existing = db.get(FutureRecord, future_id)
    if existing is None:
        db.add_all([*extra_rows, FutureRecord(id=future_id, session_id=session_id, model_id=model_id,
                                               request_type=request_type, seq_id=seq_id, request=body,
                                               request_hash=digest)])
        try:
            db.commit()
        except IntegrityError:  # a concurrent retry won the race: fall through to the comparison
            db.rollback()
            existing = db.get(FutureRecord, future_id)
            if existing is None:
                raise
    if existing is not None and existing.request_hash != digest:
        raise ConflictError(f"{request_type}: request {future_id} was already submitted with a different body; "
                            "use a new seq_id for a new request")
    request.app.state.wake_engine()
    return future_id


def require_model(db: Session, model_id: str) -> ModelRecord:
    model = db.get(ModelRecord, model_id)
    if model is None or model.status == ModelStatus.UNLOADED.value:
        raise NotFoundError(f"model {model_id!r} not found; create it with create_model (or a training client) first")
    return model
