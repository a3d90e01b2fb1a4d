"""SeqOrder: which of a model's queued requests may run now, in seq_id order, never skipping a missing seq_id.

A model's requests run in the order the SDK numbered them. Every request the API rejects after reading its seq_id
is stored as a failed future (api/submit.py), so a gap is always a request still on its way (a slow upload): it is
waited for, logged every GAP_LOG_EVERY_S, until the model is unloaded (an unload request, a finished or expired
session); then what waited behind it cannot run and is handed back to fail.
"""

from __future__ import annotations

import logging
from datetime import datetime, timezone
from typing import NamedTuple

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from skyrl_tx.db.future_queries import FutureRow
from skyrl_tx.db.models import FutureRecord, FutureStatus

log = logging.getLogger("skyrl_tx.engine")

GAP_LOG_EVERY_S = 30.0  # how often a model still waiting for a missing seq_id says so in the log
MAX_HELD = 100_000  # held / released request ids kept for their phase times; a bound against a leak


class Runnable(NamedTuple):
    """What may run now (a prefix of the queue, or just its unload), and what can never run (behind a gap that
    an unload ended), with the seq_id it waited for."""

    now: list[FutureRow]
    never: list[FutureRow]
    missing: int | None


class SeqOrder:
    """Per-model progress: the highest seq_id finished without a gap before it, and the gap being waited on."""

    def __init__(self, sessions: sessionmaker[Session]):
        self.sessions = sessions
        self._last_seq: dict[str, int] = {}  # model id → highest seq_id finished, no gap before it
        self._gaps: dict[str, tuple[int, float]] = {}  # model id → (missing seq_id, when it was last logged)
        # Phase times (stored by the engine with each result: FutureOutcome.ordered_at): the ids a scan held back
        # behind a gap, and when each became runnable; EngineStats.timings takes them out as the request finishes.
        self._held: set[str] = set()
        self.released: dict[str, datetime] = {}

    def runnable(self, model_id: str, queue: list[FutureRow]) -> Runnable:
        """`queue` sorted by seq_id (unsequenced requests, i.e. the unload, last)."""
        last = self._last_seq.get(model_id)
        if last is None:  # the engine runs a model's requests in order: its newest completed one marks progress
            with self.sessions() as db:
                last = db.scalar(select(func.max(FutureRecord.seq_id)).where(
                    FutureRecord.model_id == model_id, FutureRecord.status == FutureStatus.COMPLETED.value)) or 0
            last = self._last_seq[model_id] = self._finished_through(model_id, last)
        now: list[FutureRow] = []
        for i, f in enumerate(queue):
            if f.seq_id is not None and f.seq_id > last + 1:
                # The API may have stored the missing ones as failed (rejected at its edge): read them once.
                last = self._last_seq[model_id] = self._finished_through(model_id, last)
                if f.seq_id > last + 1:
                    unload = next((u for u in queue[i:] if u.request_type == "unload_model"), None)
                    if unload is not None:  # the model ends: what waits behind the gap can never run
                        self._gaps.pop(model_id, None)
                        return Runnable(now + [unload], [b for b in queue[i:] if b is not unload], last + 1)
                    self._log_gap(model_id, last + 1, f)
                    self._hold(queue[i:])
                    return Runnable(now, [], last + 1)
            if f.id in self._held:
                self._held.discard(f.id)
                self.released[f.id] = datetime.now(timezone.utc)
            now.append(f)
            if f.seq_id is not None:
                last = f.seq_id
        self._gaps.pop(model_id, None)
        return Runnable(now, [], None)

    def _hold(self, waiting: list[FutureRow]) -> None:
        if len(self._held) > MAX_HELD or len(self.released) > MAX_HELD:
            self._held.clear()
            self.released.clear()
        self._held.update(f.id for f in waiting if f.seq_id is not None)

    def finished(self, model_id: str, seq_id: int) -> None:
        self._last_seq[model_id] = max(self._last_seq.get(model_id, 0), seq_id)

    def forget(self, model_id: str) -> None:
        self._gaps.pop(model_id, None)

    def waiting_for(self, model_id: str) -> int | None:
        """The missing seq_id a model's queued requests wait for, if any."""
        gap = self._gaps.get(model_id)
        return gap[0] if gap else None

    def _finished_through(self, model_id: str, last: int) -> int:
        """`last` advanced over the model's finished (completed or failed) seq_ids that follow it without a gap."""
        with self.sessions() as db:
            done = db.scalars(select(FutureRecord.seq_id).where(
                FutureRecord.model_id == model_id, FutureRecord.seq_id > last,
                FutureRecord.status.in_([FutureStatus.COMPLETED.value, FutureStatus.FAILED.value]))).all()
        for seq_id in sorted(done):
            if seq_id != last + 1:
                break
            last = seq_id
        return last

    def _log_gap(self, model_id: str, missing: int, waiting: FutureRow) -> None:
        now = datetime.now(timezone.utc).timestamp()
        seen = self._gaps.get(model_id)
        if seen is not None and seen[0] == missing and now - seen[1] < GAP_LOG_EVERY_S:
            return
        self._gaps[model_id] = (missing, now)
        log.warning("model %s: request seq_id %d has not arrived; seq_id %d and later wait for it (for %.0f s so "
                    "far; until the model is unloaded or its session ends)", model_id, missing, waiting.seq_id,
                    now - waiting.created_at.timestamp())
