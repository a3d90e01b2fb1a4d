"""EngineRunner: hosts the EngineLoop in a thread of the server process; a crashed step never stops it."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from skyrl_tx.checkpoints.store import CheckpointStore
from skyrl_tx.engine.checkpointing import Checkpointer
from skyrl_tx.engine.loop import EngineLoop

log = logging.getLogger("skyrl_tx.engine")

IDLE_WAIT_S = 0.05  # upper bound on pick-up latency if a wake-up is ever missed; wake() is the hot path
SWEEP_EVERY_S = 5.0  # how often silent sessions are looked for


class EngineRunner:
    """Owns the backend (built in the engine thread, so only that thread ever touches it)."""

    def __init__(self, backend_factory: Callable[[], Any], session_factory: sessionmaker[Session],
                 store: CheckpointStore, model_dir: Path,
                 on_finished: Callable[[Iterable[str]], None] = lambda ids: None, session_timeout_s: float = 300.0):
        self._backend_factory = backend_factory
        self._store = store
        self._model_dir = model_dir
        self._sessions = session_factory
        self._on_finished = on_finished
        self._session_timeout_s = session_timeout_s
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.ready = threading.Event()
        self.failed: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="skyrl-tx-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        """Called by the API after it stores a request: the loop picks it up at once."""
        self._wake.set()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            backend = self._backend_factory()
        except BaseException as exc:  # noqa: BLE001 - surfaced by the server at startup
            self.failed = exc
            log.exception("engine: loading the backend failed")
            self.ready.set()
            return
        checkpointer = Checkpointer(backend, self._store, self._sessions, self._model_dir)
        loop = EngineLoop(backend, self._sessions, checkpointer, notify=self._on_finished,
                          session_timeout_s=self._session_timeout_s)
        loop.recover()
        self.ready.set()
        next_sweep = time.monotonic() + SWEEP_EVERY_S
        while not self._stop.is_set():
            try:
                if time.monotonic() >= next_sweep:
                    next_sweep = time.monotonic() + SWEEP_EVERY_S
                    loop.expire_sessions()
                worked = loop.step()
            except Exception:  # noqa: BLE001 - the loop restarts; failed requests already carry their error
                log.exception("engine step failed; continuing")
                worked = False
            if not worked:
                self._wake.wait(IDLE_WAIT_S)
                self._wake.clear()
