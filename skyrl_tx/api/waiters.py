"""FutureWaiters: wakes retrieve_future long-polls the moment the engine finishes their future, with its outcome, and
retrieve_futures long-polls the moment a sample of their completion queue finishes."""

from __future__ import annotations

import asyncio
from collections import defaultdict

from skyrl_tx.db.completion_queues import queue_of_future
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
        self._queues: dict[str, set[Waiter]] = defaultdict(set)  # completion queue → its retrieve_futures polls

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def register(self, future_id: str) -> Waiter:
        """Register before reading the future's state, so a result written in between is not missed."""
        waiter = Waiter()
        self._waiting[future_id].add(waiter)
        return waiter

    def unregister(self, future_id: str, waiter: Waiter) -> None:
        _discard(self._waiting, future_id, waiter)

    def register_queue(self, queue: str) -> Waiter:
        """A retrieve_futures poll of a completion queue (db/completion_queues.py): woken by any of its samples
        finishing (its `outcome` stays None: the poll reads the queue). Register before reading, as above."""
        waiter = Waiter()
        self._queues[queue].add(waiter)
        return waiter

    def unregister_queue(self, queue: str, waiter: Waiter) -> None:
        _discard(self._queues, queue, waiter)

    def notify_threadsafe(self, outcomes: list[FutureOutcome]) -> None:
        """Called from the engine thread (or the engine process's reader thread)."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._deliver, outcomes)

    def deliver(self, outcomes: list[FutureOutcome]) -> None:
        """On the event loop: the API itself finished these futures (cancel_future)."""
        self._deliver(outcomes)

    def _deliver(self, outcomes: list[FutureOutcome]) -> None:
        for outcome in outcomes:  # outcomes nobody waits for are dropped: the database has them
            for waiter in self._waiting.get(outcome.id, ()):
                waiter.outcome = outcome
                waiter.event.set()
            if self._queues and outcome.request_type == "sample":
                for waiter in self._queues.get(queue_of_future(outcome.id) or "", ()):
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


def _discard(registry: dict[str, set[Waiter]], key: str, waiter: Waiter) -> None:
    waiting = registry.get(key)
    if waiting is not None:
        waiting.discard(waiter)
        if not waiting:
            del registry[key]
