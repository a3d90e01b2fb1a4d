"""Prebuilt Core statements for the futures hot path: store a request, claim it, finish it, read its outcome.

Every training and sampling call goes through these once or twice on the API side and twice in the engine.
Built once and executed with parameters, they skip the ORM's unit of work, identity map and per-call statement
construction, and read only the columns the caller needs: the engine's scan reads metadata, never a binary body
(it loads the bodies of the requests it claims), and polling never reads the request. `python -m skyrl_tx.bench api`
measures what that saves; `python -m skyrl_tx.bench.bodies` what binary bodies save on a large forward_backward.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any, NamedTuple, Protocol

from sqlalchemy import bindparam, func, insert, select, update

from skyrl_tx.db.models import FutureRecord, FutureStatus, ModelRecord, SamplingSessionRecord

FUTURES = FutureRecord.__table__
MODELS = ModelRecord.__table__
SAMPLERS = SamplingSessionRecord.__table__



class FutureRow(Protocol):
    """What the engine reads of a request: a Core row of PENDING, or a FutureRecord (same attribute names). Its
    binary body, if any, is loaded separately (engine/executor.py: train_requests)."""

    id: str
    session_id: str | None
    model_id: str | None
    request_type: str
    seq_id: int | None
    request: dict[str, Any]
    attempts: int
    created_at: datetime
    request_id: str | None  # X-Request-Id of the HTTP request that made it (None: rows from before migration 0006)


class FutureOutcome(NamedTuple):
    """A finished future as retrieve_future renders it (OUTCOME's columns, plus its id). The engine hands it to
    the API with its notification, so the long-poll it wakes need not read back what the engine just stored.
    `result` is JSON-able, or bytes: a binary result body (the ForwardBackwardOutput protobuf), stored in
    `result_body`; or RESULT_IN_DATABASE where a notification from another process left the bytes out.
    `queue_s` (stored -> claimed by the engine) and `engine_s` (claimed -> done) are set by the engine for the
    API's latency histograms (api/metrics.py); None where the outcome was read back from the database.
    `ordered_at` (a request held behind a missing seq_id became runnable) and `computed_at` (its compute returned)
    are phase times the engine stores with the result (FINISH; db/request_timings.py reads them back); the
    notification between processes leaves them out (outcome_to_json)."""

    id: str
    status: str
    request_type: str
    result: Any
    error: dict[str, Any] | None
    queue_s: float | None = None
    engine_s: float | None = None
    ordered_at: datetime | None = None
    computed_at: datetime | None = None


class _InDatabase:
    def __repr__(self) -> str:
        return "RESULT_IN_DATABASE"


RESULT_IN_DATABASE: Any = _InDatabase()  # an outcome whose binary result is read from the database, not sent


def outcome_to_json(o: FutureOutcome) -> list[Any]:
    """An outcome for a JSON message between processes: a binary result stays in the database (re-reading ~1 MB
    there is cheaper than encoding it as text and decoding it again)."""
    binary = isinstance(o.result, bytes)
    return [o.id, o.status, o.request_type, None if binary else o.result, o.error, binary, o.queue_s, o.engine_s]


def outcome_from_json(fields: list[Any]) -> FutureOutcome:
    id_, status, request_type, result, error, *rest = fields
    binary = bool(rest and rest[0])
    queue_s, engine_s = (rest[1], rest[2]) if len(rest) >= 3 else (None, None)
    return FutureOutcome(id_, status, request_type, RESULT_IN_DATABASE if binary else result, error, queue_s,
                         engine_s)


def finish_params(outcomes: list[FutureOutcome], now: datetime) -> list[dict[str, Any]]:
    """FINISH's parameters: a bytes result goes to the binary column, anything else to the JSON one."""
    return [{"id_": o.id, "status_": o.status, "error_": o.error, "now": now, "ordered_": o.ordered_at,
             "computed_": o.computed_at,
             "result_": None if isinstance(o.result, bytes) else o.result,
             "result_body_": o.result if isinstance(o.result, bytes) else None} for o in outcomes]


Notify = Callable[[list[FutureOutcome]], None]  # the engine's "these futures just finished"


# The engine's scan: every pending request, oldest first (rows with the FutureRecord attribute names), metadata only.
PENDING = select(FUTURES.c.id, FUTURES.c.session_id, FUTURES.c.model_id, FUTURES.c.request_type, FUTURES.c.seq_id,
                 FUTURES.c.request, FUTURES.c.attempts, FUTURES.c.created_at, FUTURES.c.request_id).where(
    FUTURES.c.status == FutureStatus.PENDING.value).order_by(FUTURES.c.created_at)
# The binary bodies of the requests the engine claimed (an expanding IN list: one round trip per batch).
REQUEST_BODIES = select(FUTURES.c.id, FUTURES.c.request_body).where(FUTURES.c.id.in_(bindparam("ids", expanding=True)))
# The JSON requests of the given futures (a custom loss's graph lives in its create_custom_loss request).
REQUESTS_OF = select(FUTURES.c.id, FUTURES.c.request).where(FUTURES.c.id.in_(bindparam("ids", expanding=True)))
# Column defaults (status pending, attempts 0, created_at now) are applied by Core as well.
INSERT_FUTURE = insert(FUTURES)
REQUEST_HASH = select(FUTURES.c.request_hash).where(FUTURES.c.id == bindparam("id_"))
MODEL_STATUS = select(MODELS.c.status).where(MODELS.c.id == bindparam("id_"))
# What asample needs of its sampling session: the weights it samples from and the owning session.
SAMPLER_WEIGHTS = select(SAMPLERS.c.snapshot_id, SAMPLERS.c.session_id).where(SAMPLERS.c.id == bindparam("id_"))
# What retrieve_future renders: the row's status, type, result (JSON or binary) and error (not the request).
OUTCOME = select(FUTURES.c.status, FUTURES.c.request_type, FUTURES.c.result, FUTURES.c.result_body,
                 FUTURES.c.error).where(FUTURES.c.id == bindparam("id_"))
# executemany: one parameter dict per claimed future (an expanding IN list would be re-rendered on every call).
# Conditional: a request cancelled since the scan (CANCEL_PENDING) stays failed and is not claimed.
MARK_RUNNING = update(FUTURES).where(FUTURES.c.id == bindparam("id_"),
                                     FUTURES.c.status == FutureStatus.PENDING.value).values(
    status=FutureStatus.RUNNING.value, started_at=bindparam("now"), attempts=FUTURES.c.attempts + 1)
# Which of the futures MARK_RUNNING was given it claimed (read in its transaction, where a row count cannot tell).
CLAIMED = select(FUTURES.c.id).where(FUTURES.c.id.in_(bindparam("ids", expanding=True)),
                                     FUTURES.c.status == FutureStatus.RUNNING.value)
# cancel_future: only a request the engine has not claimed; the row count says whether it was.
CANCEL_PENDING = update(FUTURES).where(FUTURES.c.id == bindparam("id_"),
                                       FUTURES.c.status == FutureStatus.PENDING.value).values(
    status=FutureStatus.FAILED.value, error=bindparam("error_"), completed_at=bindparam("now"))
FUTURE_STATUS = select(FUTURES.c.status).where(FUTURES.c.id == bindparam("id_"))
# executemany: one parameter dict per finished future (finish_params). The phase times ride along in this UPDATE:
# recording them costs no extra statement per request.
FINISH = update(FUTURES).where(FUTURES.c.id == bindparam("id_")).values(
    status=bindparam("status_"), result=bindparam("result_"), result_body=bindparam("result_body_"),
    error=bindparam("error_"), completed_at=bindparam("now"), ordered_at=bindparam("ordered_"),
    computed_at=bindparam("computed_"))
# /metrics' queue depth (api/metrics.py, at scrape time, not per request): unfinished futures by type and status,
# read through ix_futures_status_created_at.
QUEUE_DEPTH = select(FUTURES.c.request_type, FUTURES.c.status, func.count()).where(
    FUTURES.c.status.in_((FutureStatus.PENDING.value, FutureStatus.RUNNING.value))).group_by(
    FUTURES.c.request_type, FUTURES.c.status)
# Why a queued request waits (retrieve_future's try_again): its model and seq_id, and the highest seq_id stored below.
MODEL_SEQ = select(FUTURES.c.model_id, FUTURES.c.seq_id).where(FUTURES.c.id == bindparam("id_"))
HIGHEST_SEQ_BELOW = select(func.max(FUTURES.c.seq_id)).where(
    FUTURES.c.model_id == bindparam("model_id"), FUTURES.c.seq_id < bindparam("seq_id"))
