"""RequestTimings: the API's own moments of each request (received, woken, answered), kept in a bounded in-process
ring keyed by future id.

Why memory and not the futures table: these moments happen in the API around the request's own statements, and
writing them would add a database write per request (the engine's phase times cost nothing extra: they ride in the
UPDATEs it already does, db/future_queries.py MARK_RUNNING / FINISH). The ring holds the newest MAX_ENTRIES futures
(oldest evicted first); the session trace export (api/trace/build.py) and GET .../request_timings (bench latency)
read it. What it cannot show: requests older than the ring, requests served by another API process (each process
has its own ring), and anything from before an API restart; there a request's span runs from stored to result
stored (the database's times) and says so (`api_times: false`).
"""

from __future__ import annotations

import threading
import time
from typing import Any, NamedTuple

MAX_ENTRIES = 100_000  # ~300 bytes each (id, three floats): ~30 MB at most, measured; the newest requests
RECEIVED, WOKEN, ANSWERED = 0, 1, 2


class ApiTimes(NamedTuple):
    """Unix seconds (None: not seen by this process): the HTTP request that submitted it arrived; the first poll saw
    it finished; that poll's response was sent."""

    received: float | None
    woken: float | None
    answered: float | None


class RequestTimings:
    """First value wins for each moment: a retried submit keeps the attempt that stored it, a second poll of a
    finished future keeps the first wake-up and answer. Thread-safe (submits record from worker threads)."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._times: dict[str, list[float | None]] = {}
        self._lock = threading.Lock()

    def _set(self, future_id: str, which: int, at: float) -> None:
        with self._lock:
            entry = self._times.get(future_id)
            if entry is None:
                if len(self._times) >= self.max_entries:  # dicts keep insertion order: the first key is the oldest
                    del self._times[next(iter(self._times))]
                entry = self._times[future_id] = [None, None, None]
            if entry[which] is None:
                entry[which] = at

    def received(self, future_id: str, at: float) -> None:
        self._set(future_id, RECEIVED, at)

    def woken(self, future_id: str, at: float | None = None) -> None:
        self._set(future_id, WOKEN, time.time() if at is None else at)

    def answered(self, future_id: str, at: float | None = None) -> None:
        self._set(future_id, ANSWERED, time.time() if at is None else at)

    def get(self, future_id: str) -> ApiTimes:
        with self._lock:
            entry = self._times.get(future_id)
            return ApiTimes(*entry) if entry is not None else ApiTimes(None, None, None)

    def __len__(self) -> int:
        return len(self._times)


def ring_of(app: Any) -> RequestTimings | None:
    """The app's ring (create_app makes it), or None for an app without one."""
    return getattr(getattr(app, "state", None), "request_timings", None)


# ---- hooks (the request-context middleware and the routes call these) ------------------------------------------
def mark_received(scope: dict[str, Any]) -> None:
    """At the very start of an HTTP request: its arrival, for submit_future to file under the future it stores."""
    scope.setdefault("state", {})["received_at"] = time.time()


def record_submitted(app: Any, state: dict[str, Any], future_id: str) -> None:
    ring = ring_of(app)
    received = state.get("received_at")
    if ring is not None and received is not None:
        ring.received(future_id, received)


def record_answered(scope: dict[str, Any]) -> None:
    """When the response's last bytes go to the server (RequestContext, before they are sent): where a
    retrieve_future answered with a finished future, that future's answer."""
    state = scope.get("state")
    future_id = state.get("answered_future") if state else None
    if future_id is not None:
        ring = ring_of(scope.get("app"))
        if ring is not None:
            ring.answered(future_id)
