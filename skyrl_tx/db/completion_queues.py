"""Completion queues of sampling sessions (retrieve_futures): which queue a sample is in, and its cursor there.

SDK 0.38 polls one queue per (sampling session, cloned sampler): its samples as they finish, each once, in the order
of a cursor it hands back. A sample's queue is stored with it (`futures.completion_queue`, by asample). Its cursor
is handed out by the poll that first sees it finished (`futures.completion_cursor`), above every cursor of the
queue so far and above the caller's: only the poll numbers, so the engine's hot path writes nothing more, and
the order is the order polls saw completions in, which no commit order of the engine's writes can break.
A response that never arrived is answered again: the rows above the caller's cursor are read back as they are.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from sqlalchemy import Engine, bindparam, func, select, update
from sqlalchemy.exc import IntegrityError

from skyrl_tx.db.models import FutureRecord, FutureStatus

FUTURES = FutureRecord.__table__
CLONE_SEQ_BLOCK = 1_000_000_000  # the SDK numbers a cloned sampler's requests from clone * 1e9
FINISHED = (FutureStatus.COMPLETED.value, FutureStatus.FAILED.value)
NUMBERING_TRIES = 3  # concurrent polls of one queue (the SDK runs one) may pick the same cursor: try again

# Finished samples of the queue not numbered yet, oldest first (the unique index on (queue, cursor) finds them).
UNNUMBERED = select(FUTURES.c.id).where(
    FUTURES.c.completion_queue == bindparam("queue"), FUTURES.c.completion_cursor.is_(None),
    FUTURES.c.status.in_(FINISHED)).order_by(FUTURES.c.completed_at, FUTURES.c.id).limit(bindparam("limit"))
TOP_CURSOR = select(func.max(FUTURES.c.completion_cursor)).where(FUTURES.c.completion_queue == bindparam("queue"))
# executemany; conditional, so a row another poll numbered meanwhile keeps its cursor.
NUMBER = update(FUTURES).where(FUTURES.c.id == bindparam("id_"), FUTURES.c.completion_cursor.is_(None)).values(
    completion_cursor=bindparam("cursor"))
SINCE = select(FUTURES.c.id, FUTURES.c.status, FUTURES.c.completion_cursor).where(
    FUTURES.c.completion_queue == bindparam("queue"), FUTURES.c.completion_cursor > bindparam("after")).order_by(
    FUTURES.c.completion_cursor).limit(bindparam("limit"))


class Completion(NamedTuple):
    request_id: str
    status: str  # completed or failed
    cursor: int


def queue_name(sampling_session_id: str, cloned_sampler_id: int) -> str:
    return f"{sampling_session_id}#{cloned_sampler_id}"


def queue_of_sample(sampling_session_id: str, seq_id: int) -> str:
    """The queue of a sample the SDK numbered `seq_id` (its cloned sampler is seq_id // 1e9, as the SDK counts)."""
    return queue_name(sampling_session_id, seq_id // CLONE_SEQ_BLOCK)


def queue_of_future(future_id: str) -> str | None:
    """The queue of a sample future's id (`<sampling session>:<seq_id>`, api/routes/sampling.py); None for an id
    of another form."""
    sampling_session_id, _, seq = future_id.rpartition(":")
    try:
        return queue_of_sample(sampling_session_id, int(seq)) if sampling_session_id else None
    except ValueError:
        return None


def completions_since(database: Engine, queue: str, prev_cursor: int, limit: int) -> tuple[list[Completion], int]:
    """The queue's completions after `prev_cursor` (at most `limit`, by cursor), numbering the newly finished ones
    first; and the cursor to hand back: the last one returned, else `prev_cursor`."""
    for attempt in range(NUMBERING_TRIES):
        try:
            with database.begin() as db:
                _number_new(db, queue, prev_cursor, limit)
                rows = db.execute(SINCE, {"queue": queue, "after": prev_cursor, "limit": limit}).all()
            break
        except IntegrityError:  # another poll of this queue handed out the same cursor first
            if attempt == NUMBERING_TRIES - 1:
                raise
    completions = [Completion(r.id, r.status, r.completion_cursor) for r in rows]
    return completions, completions[-1].cursor if completions else prev_cursor


def _number_new(db: Any, queue: str, prev_cursor: int, limit: int) -> None:
    new = db.execute(UNNUMBERED, {"queue": queue, "limit": limit}).scalars().all()
    if not new:
        return
    # Above the caller's cursor too: one from before a database reset (or a retention sweep that removed the
    # queue's newest rows) must still see what finishes now.
    top = max(db.execute(TOP_CURSOR, {"queue": queue}).scalar() or 0, prev_cursor)
    db.execute(NUMBER, [{"id_": future_id, "cursor": top + i} for i, future_id in enumerate(new, start=1)])
