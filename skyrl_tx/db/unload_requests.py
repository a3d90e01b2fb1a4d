"""request_unloads: stores an unload_model request for each model of a finished or expired session.

An unload is an ordinary (unsequenced) request of its model, so the engine runs it after the model's accepted
requests, keeps it waiting while the model still serves samples, and fails what waits behind a seq_id that
will now never arrive (engine/loop.py). The API's `sessions/{id}/finish` and the engine's session-timeout
sweep both end a session this way, so its adapter slots are free as soon as its work is done.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from skyrl_tx.db.models import FutureRecord, ModelRecord, ModelStatus, request_hash

UNLOADABLE = (ModelStatus.PENDING.value, ModelStatus.READY.value)


def unload_future_id(model_id: str) -> str:
    return f"{model_id}:unload"


def request_unloads(db: Session, session_id: str) -> list[str]:
    """Adds (in the caller's transaction) an unload request for each live model of the session that has none
    yet; returns their model ids."""
    models = db.scalars(select(ModelRecord.id).where(ModelRecord.session_id == session_id,
                                                     ModelRecord.status.in_(UNLOADABLE))).all()
    added = []
    for model_id in models:
        if db.get(FutureRecord, unload_future_id(model_id)) is not None:
            continue  # already asked for (an explicit unload_model, or a second finish)
        body = {"model_id": model_id}
        db.add(FutureRecord(id=unload_future_id(model_id), session_id=session_id, model_id=model_id,
                            request_type="unload_model", request=body, request_hash=request_hash(body)))
        added.append(model_id)
    return added
