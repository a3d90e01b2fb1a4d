"""FutureWaiters: wakes retrieve_future long-polls the moment the engine finishes their future, with its outcome."""

from __future__ import annotations

import asyncio
from collections import defaultdict

from skyrl_tx.db.future_queries import FutureOutcome


class Waiter:
    """One long-poll's wake-up: `event` is set when the future finishes; `outcome` is what the engine stored."""

    __slots__ = ("event", "outcome", "progress")

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.outcome: FutureOutcome | None = None
        self.progress: list[list[list[int]]] = []  # streaming: new tokens per sample, one entry per decode step


class FutureWaiters:
    """Engine thread → event loop handoff; the hot path never waits on a polling interval, and a woken long-poll
    answers from the outcome it was handed instead of reading the database again."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiting: dict[str, set[Waiter]] = defaultdict(set)

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def register(self, future_id: str) -> Waiter:
        """Register before reading the future's state, so a result written in between is not missed."""
        waiter = Waiter()
        self._waiting[future_id].add(waiter)
        return waiter

    def unregister(self, future_id: str, waiter: Waiter) -> None:
        waiting = self._waiting.get(future_id)
        if waiting is not None:
            waiting.discard(waiter)
            if not waiting:
                del self._waiting[future_id]

    def notify_threadsafe(self, outcomes: list[FutureOutcome]) -> None:
        """Called from the engine thread (or the engine process's reader thread)."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._deliver, outcomes)

    def _deliver(self, outcomes: list[FutureOutcome]) -> None:
        for outcome in outcomes:  # outcomes nobody waits for are dropped: the database has them
            for waiter in self._waiting.get(outcome.id, ()):
                waiter.outcome = outcome
                waiter.event.set()

    def progress_threadsafe(self, items: list[tuple[str, list[list[int]]]]) -> None:
        """A streaming sample's new tokens (engine thread or reader thread); the event is set as for an outcome."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._deliver_progress, items)

    def _deliver_progress(self, items: list[tuple[str, list[list[int]]]]) -> None:
        for future_id, tokens in items:
            for waiter in self._waiting.get(future_id, ()):
                waiter.progress.append(tokens)
                waiter.event.set()
