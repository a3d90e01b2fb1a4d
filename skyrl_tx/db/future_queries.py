"""Prebuilt Core statements for the futures hot path: store a request, claim it, finish it, read its outcome.

Every training and sampling call goes through these once or twice on the API side and twice in the engine.
Built once and executed with parameters, they skip the ORM's unit of work, identity map and per-call statement
construction, and read only the columns the caller needs (never the stored request body when polling);
`python -m skyrl_tx.bench api` measures what that saves.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any, NamedTuple, Protocol

from sqlalchemy import bindparam, insert, select, update

from skyrl_tx.db.models import FutureRecord, FutureStatus, ModelRecord, SamplingSessionRecord

FUTURES = FutureRecord.__table__
MODELS = ModelRecord.__table__
SAMPLERS = SamplingSessionRecord.__table__



class FutureRow(Protocol):
    """What the engine reads of a request: a Core row of PENDING, or a FutureRecord (same attribute names)."""

    id: str
    session_id: str | None
    model_id: str | None
    request_type: str
    seq_id: int | None
    request: dict[str, Any]
    attempts: int
    created_at: datetime


class FutureOutcome(NamedTuple):
    """A finished future as retrieve_future renders it (OUTCOME's columns, plus its id). The engine hands it to
    the API with its notification, so the long-poll it wakes need not read back what the engine just stored."""

    id: str
    status: str
    request_type: str
    result: Any
    error: dict[str, Any] | None


Notify = Callable[[list[FutureOutcome]], None]  # the engine's "these futures just finished"


# The engine's scan: every pending request, oldest first (rows with the FutureRecord attribute names).
PENDING = select(FUTURES).where(FUTURES.c.status == FutureStatus.PENDING.value).order_by(FUTURES.c.created_at)
# Column defaults (status pending, attempts 0, created_at now) are applied by Core as well.
INSERT_FUTURE = insert(FUTURES)
REQUEST_HASH = select(FUTURES.c.request_hash).where(FUTURES.c.id == bindparam("id_"))
MODEL_STATUS = select(MODELS.c.status).where(MODELS.c.id == bindparam("id_"))
# What asample needs of its sampling session: the weights it samples from and the owning session.
SAMPLER_WEIGHTS = select(SAMPLERS.c.snapshot_id, SAMPLERS.c.session_id).where(SAMPLERS.c.id == bindparam("id_"))
# What retrieve_future renders: the row's status, type, result and error (not the request).
OUTCOME = select(FUTURES.c.status, FUTURES.c.request_type, FUTURES.c.result, FUTURES.c.error).where(
    FUTURES.c.id == bindparam("id_"))
# executemany: one parameter dict per claimed future (an expanding IN list would be re-rendered on every call).
MARK_RUNNING = update(FUTURES).where(FUTURES.c.id == bindparam("id_")).values(
    status=FutureStatus.RUNNING.value, started_at=bindparam("now"), attempts=FUTURES.c.attempts + 1)
# executemany: one parameter dict per finished future.
FINISH = update(FUTURES).where(FUTURES.c.id == bindparam("id_")).values(
    status=bindparam("status_"), result=bindparam("result_"), error=bindparam("error_"), completed_at=bindparam("now"))
