"""FutureWaiters: wakes retrieve_future long-polls the moment the engine finishes their future."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Iterable


class FutureWaiters:
    """Engine thread → event loop handoff; the hot path never waits on a polling interval."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._events: dict[str, set[asyncio.Event]] = defaultdict(set)

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def register(self, future_id: str) -> asyncio.Event:
        """Register before reading the future's state, so a result written in between is not missed."""
        event = asyncio.Event()
        self._events[future_id].add(event)
        return event

    def unregister(self, future_id: str, event: asyncio.Event) -> None:
        waiting = self._events.get(future_id)
        if waiting is not None:
            waiting.discard(event)
            if not waiting:
                del self._events[future_id]

    def notify_threadsafe(self, future_ids: Iterable[str]) -> None:
        """Called from the engine thread."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._set, list(future_ids))

    def _set(self, future_ids: list[str]) -> None:
        for future_id in future_ids:
            for event in self._events.get(future_id, ()):
                event.set()
