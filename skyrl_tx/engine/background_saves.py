"""BackgroundSaves: checkpoint writes (serialise, write, upload) on a worker thread, off the engine loop.

The engine thread takes a private host copy of what is saved (the backend returns copies) and submits a job
that only writes files: it never touches the backend. The engine learns what finished by polling
`finished()` once per step, and stores those results itself (so the future and the checkpoint row change on
the engine thread, in the order the engine decides). `on_done` is called from the worker when a job ends, so
an idle engine wakes at once instead of at its next idle poll.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

log = logging.getLogger("skyrl_tx.engine")

SAVE_WORKERS = 1  # one save at a time: host copies waiting in the queue are the only extra memory


def _yield_to_the_engine() -> None:
    """The writer runs at a lower CPU priority than the engine thread (Linux nice values are per thread): on a
    machine with few cores, serialising a checkpoint must not slow every user's decode steps."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), min(19, os.getpriority(os.PRIO_PROCESS, 0) + 10))
    except (AttributeError, OSError):  # not Linux, or not permitted: the write still runs, at normal priority
        pass


class BackgroundSaves:
    def __init__(self, workers: int = SAVE_WORKERS):
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="skyrl-tx-saves",
                                        initializer=_yield_to_the_engine)
        self._lock = threading.Lock()
        self._running: dict[Future[Any], tuple[str, Any]] = {}  # job → (model id, the caller's token)
        self._done: list[tuple[str, Any, Any, BaseException | None]] = []  # ended, not yet polled
        self.on_done: Callable[[], None] = lambda: None  # run_engine sets its wake-up event here

    def submit(self, model_id: str, token: Any, job: Callable[[], Any]) -> None:
        """Runs job() on the worker; (token, its result or exception) comes back from finished()."""
        future = self._pool.submit(job)
        with self._lock:
            self._running[future] = (model_id, token)
        future.add_done_callback(self._collect)

    def _collect(self, future: Future[Any]) -> None:
        with self._lock:
            model_id, token = self._running.pop(future)  # registered before the callback was added
            error = future.exception()
            self._done.append((model_id, token, None if error else future.result(), error))
        try:
            self.on_done()
        except Exception:  # a failed wake-up only delays the poll to the engine's idle wait
            log.exception("save finished, but waking the engine failed")

    def finished(self) -> list[tuple[Any, Any, BaseException | None]]:
        """The jobs that ended since the last call: (token, result or None, exception or None)."""
        with self._lock:
            done, self._done = self._done, []
        return [(token, result, error) for _, token, result, error in done]

    def busy(self, model_id: str) -> bool:
        """Whether a save of `model_id` is being written or ended but not yet polled."""
        with self._lock:
            return any(m == model_id for m, _ in self._running.values()) or any(d[0] == model_id for d in self._done)

    def in_flight(self) -> int:
        with self._lock:
            return len(self._running) + len(self._done)

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until every submitted job has ended (tests, shutdown); True if none is left running."""
        with self._lock:
            futures = list(self._running)
        for f in futures:
            try:
                f.exception(timeout=timeout)
            except TimeoutError:
                return False
        return True

    def close(self) -> None:
        self._pool.shutdown(wait=True)
