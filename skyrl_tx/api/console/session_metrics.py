"""A session's live metrics from its futures (the engine's own records, nothing counted on the request path): loss
and tokens/s per forward_backward of each training run, and requests in flight over time.

Loss is the step's `loss:sum` metric, read from the stored ForwardBackwardOutput protobuf (skyrl_tx/wire/codec.py,
numpy only); tokens/s is the request's input tokens over its engine time (claimed -> result stored). Finished
futures are kept futures_retention_hours (24 h by default): older steps drop off the plots."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from google.protobuf.message import DecodeError
from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from skyrl_tx.db.models import FutureRecord, FutureStatus, ModelRecord
from skyrl_tx.db.request_timings import input_tokens
from skyrl_tx.wire.codec import decode_forward_backward_output

F, M = FutureRecord.__table__, ModelRecord.__table__
MAX_STEPS = 2000  # per run: the newest; a plot of more points says nothing more
MAX_EVENTS = 4000  # in-flight changes: the newest
WINDOW_S = 600.0  # the in-flight plot shows the last ten minutes (or less, since the session's first request)
CACHE_MAX = 100_000  # finished steps whose (loss, tokens) are kept: a finished future never changes
INFLIGHT = (FutureStatus.PENDING.value, FutureStatus.RUNNING.value)


@dataclass
class RunSteps:
    """One training run's forward_backward steps, oldest first: step numbers (1-based, of the steps still kept),
    loss:sum (None when the loss reported none) and tokens/s (None without engine timestamps)."""

    run_id: str
    steps: list[int] = field(default_factory=list)
    loss: list[float | None] = field(default_factory=list)
    tokens_per_s: list[float | None] = field(default_factory=list)


class StepCache:
    """future id -> (loss:sum, input tokens) of finished steps, so a page polled every few seconds decodes each
    step's result once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, tuple[float | None, int]] = {}

    def get(self, future_id: str) -> tuple[float | None, int] | None:
        with self._lock:
            return self._values.get(future_id)

    def put(self, values: dict[str, tuple[float | None, int]]) -> None:
        with self._lock:
            if len(self._values) + len(values) > CACHE_MAX:
                self._values.clear()
            self._values.update(values)


def _decoded(row: Any) -> tuple[float | None, int]:
    loss = None
    if row.result_body is not None:
        try:
            loss = decode_forward_backward_output(row.result_body)[2].get("loss:sum")
        except (DecodeError, ValueError):  # stored by this server, so never; one missing point, not a failed page
            loss = None
    return loss, input_tokens(row.request_body, row.request or {})


def _seconds(start: datetime | None, end: datetime | None) -> float | None:
    if start is None or end is None:
        return None
    seconds = (end - start).total_seconds()
    return seconds if seconds > 0 else None


def run_steps(db: Session, run_ids: list[str], cache: StepCache) -> list[RunSteps]:
    """The completed forward_backward steps of `run_ids` (the caller has checked it may see them), per run."""
    found: list[RunSteps] = []
    for run_id in run_ids:
        rows = db.execute(select(F.c.id, F.c.started_at, F.c.completed_at).where(
            F.c.model_id == run_id, F.c.request_type == "forward_backward",
            F.c.status == FutureStatus.COMPLETED.value).order_by(F.c.seq_id.desc()).limit(MAX_STEPS)).all()[::-1]
        missing = [r.id for r in rows if cache.get(r.id) is None]
        if missing:
            bodies = db.execute(select(F.c.id, F.c.request, F.c.request_body, F.c.result_body)
                                .where(F.c.id.in_(missing)))
            cache.put({b.id: _decoded(b) for b in bodies})
        run = RunSteps(run_id)
        for step, row in enumerate(rows, start=1):
            loss, tokens = cache.get(row.id) or (None, 0)
            seconds = _seconds(row.started_at, row.completed_at)
            run.steps.append(step)
            run.loss.append(loss)
            run.tokens_per_s.append(tokens / seconds if seconds else None)
        found.append(run)
    return found


def inflight(db: Session, session_id: str, now: datetime) -> tuple[list[tuple[float, int]], int]:
    """Requests of the session (its runs' and its own: samples, model creation) queued or running over the last
    WINDOW_S seconds, as (seconds before now, count) at each change, oldest first; and the count now."""
    rows = db.execute(select(F.c.created_at, F.c.completed_at, F.c.status)
                      .where(or_(F.c.model_id.in_(select(M.c.id).where(M.c.session_id == session_id)),
                                 F.c.session_id == session_id))
                      .order_by(F.c.created_at.desc()).limit(MAX_EVENTS // 2)).all()
    changes: list[tuple[datetime, int]] = []
    for row in rows:
        changes.append((row.created_at, 1))
        if row.status not in INFLIGHT:  # finished (a failure too): out of flight when its outcome was stored
            changes.append((row.completed_at or row.created_at, -1))
    changes.sort(key=lambda change: change[0])
    series, level = [], 0
    for at, delta in changes:
        level += delta
        series.append((-(now - at).total_seconds(), level))
    current = sum(1 for row in rows if row.status in INFLIGHT)
    if not series:
        return series, current
    series.append((0.0, current))  # the level holds until now
    shown = [point for point in series if point[0] >= -WINDOW_S]
    if len(shown) < len(series):  # the window opens at the level the last change before it left
        shown.insert(0, (-WINDOW_S, series[len(series) - len(shown) - 1][1]))
    return shown, current
