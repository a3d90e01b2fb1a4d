"""run_engine: the engine's main loop (recover, then step until stopped); EngineRunner hosts it in a thread."""

from __future__ import annotations

import logging
import threading
import time
from datetime import datetime, timezone
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from skyrl_tx.checkpoints.store import CheckpointStore
from skyrl_tx.db.future_queries import Notify
from skyrl_tx.engine.checkpointing import Checkpointer
from skyrl_tx.engine import retention
from skyrl_tx.engine.loop import EngineLoop
from skyrl_tx.engine.stats import CountingBackend

log = logging.getLogger("skyrl_tx.engine")

IDLE_WAIT_S = 0.05  # upper bound on pick-up latency if a wake-up is ever missed; wake() is the hot path
SWEEP_EVERY_S = 5.0  # how often silent sessions and expired checkpoints are looked for


def build_loop(backend: Any, sessions: sessionmaker[Session], store: CheckpointStore, model_dir: Path,
               notify: Notify, session_timeout_s: float, external_inference_url: str | None = None) -> EngineLoop:
    if external_inference_url:  # sampling through vLLM; training stays on the native backend
        from skyrl_tx.engine.external_sampler import ExternalSamplingBackend

        backend = ExternalSamplingBackend(backend, external_inference_url)
    backend = CountingBackend(backend)  # slots, snapshots, tokens for /metrics (engine/stats.py)
    checkpointer = Checkpointer(backend, store, sessions, model_dir)
    return EngineLoop(backend, sessions, checkpointer, notify=notify, session_timeout_s=session_timeout_s)


def run_engine(loop: EngineLoop, stop: threading.Event, wake: threading.Event,
               on_ready: Callable[[], None] = lambda: None) -> None:
    """Recovers (rebuilding models from the request log), then runs steps until `stop` is set.
    A failing step is logged and the loop goes on: its requests already carry their errors."""
    loop.checkpointer.saves.on_done = wake.set  # a save written on the worker is stored at the next step
    loop.arrived = wake.is_set  # owed decode steps stop early for a new request, so it joins the batch at once
    loop.recover()
    loop.stats.recovered()  # the replay's compute is not counted as tokens trained
    on_ready()
    sweeps = threading.Thread(target=run_sweeps, args=(loop, stop, wake), name="skyrl-tx-engine-sweeps", daemon=True)
    sweeps.start()
    scan, last_scan, idle_timed_out = True, 0.0, False
    while not stop.is_set():
        woken = wake.is_set()
        if scan:  # cleared before the scan: a request stored after it sets it again
            wake.clear()
            last_scan = time.monotonic()
        try:
            worked = loop.step(scan_pending=scan)
            oldest = loop.last_scan_new_oldest
            if scan and idle_timed_out and not woken and oldest is not None and (
                    datetime.now(timezone.utc) - oldest).total_seconds() >= IDLE_WAIT_S:
                loop.stats.missed_wakeups += 1  # it waited a whole poll interval: its wake-up never came
            loop.stats.maybe_report()
        except Exception:  # noqa: BLE001 - the loop restarts; failed requests already carry their error
            log.exception("engine step failed; continuing")
            worked = False
        idle_timed_out = False
        if not worked:
            idle_timed_out = not wake.wait(IDLE_WAIT_S)
            scan = True
            continue
        # While only samples are decoding, skip the database scan on each token unless a request arrived
        # (wake) or IDLE_WAIT_S passed (an engine without wake-ups, --engine external).
        scan = loop.had_pending or wake.is_set() or time.monotonic() - last_scan >= IDLE_WAIT_S


def run_sweeps(loop: EngineLoop, stop: threading.Event, wake: threading.Event) -> None:
    """The engine's periodic work, on a thread of its own so no request waits behind it: silent sessions' models are
    asked to unload (the engine is woken to run those requests), expired checkpoints deleted, finished futures past
    the retention pruned in bounded batches. It touches the database and the checkpoint store, never the backend."""
    while not stop.wait(SWEEP_EVERY_S):
        try:
            if loop.expire_sessions():
                wake.set()
            retention.maybe_sweep(loop)
            loop.stats.sweeps += 1
        except Exception:  # noqa: BLE001 - the next sweep tries again
            log.exception("engine sweep failed; the next one runs in %.0fs", SWEEP_EVERY_S)


class EngineRunner:
    """The engine in a thread of the server process (`--engine thread`). The thread loads the backend
    itself, so only that thread ever touches it. Same face as EngineProcess."""

    def __init__(self, settings: Any, on_finished: Notify = lambda outcomes: None):
        self._settings = settings  # EngineSettings
        self._on_finished = on_finished
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.ready = threading.Event()
        self.failed: BaseException | None = None
        self.pid: int | None = None  # no separate engine process
        self.restarts = 0
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
            self._settings.run(self._stop, self._wake, notify=self._on_finished, on_ready=self.ready.set)
        except BaseException as exc:  # noqa: BLE001 - surfaced by the server at startup
            self.failed = exc
            log.exception("engine: start-up failed")
            self.ready.set()


class ExternalEngine:
    """`--engine external`: an engine started on its own (`skyrl-tx engine`) serves this database. The
    API cannot wake it; it polls the database (IDLE_WAIT_S) and retrieve_future re-reads it."""

    pid: int | None = None
    failed: BaseException | None = None
    restarts = 0

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.ready.set()

    def start(self) -> None: ...

    def wake(self) -> None: ...

    def stop(self, timeout: float = 10.0) -> None: ...
