"""EngineProcess: runs the engine as a child process of the API server and restarts it when it dies.

Protocol over the child's pipes (no polling on the hot path): the server's first line on the engine's stdin is
its settings JSON (engine/settings.py: the database URL with its password, storage credentials), so no secret is
on the child's command line, which every user of the machine can read (`ps`, /proc/PID/cmdline); then the server
writes a line to wake it after storing a request; the engine writes `ready` once it has recovered, and
`done <JSON list of FutureOutcome>` whenever futures finish (what it just stored, so the woken long-polls
answer without reading it back), and `stats <JSON object>` about once a second (engine/stats.py: slots, KV-cache
rows, snapshots, tokens; /metrics shows them). The engine exits when its stdin closes (server gone).
Pending requests live in the database, so a restarted engine simply picks them up (engine/replay.py
rebuilds the models).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time

from collections.abc import Callable
from typing import Any

from skyrl_tx.db.future_queries import FutureOutcome, Notify, outcome_from_json, outcome_to_json

log = logging.getLogger("skyrl_tx.engine")

RESTART_DELAYS_S = (0.2, 1.0, 5.0)  # back-off between restarts after crashes in quick succession
# Tests only: a test that kills the engine ten times on purpose (tests/api/test_engine_kills.py) replaces the back-off
# with this one delay in seconds, so it does not wait ~40 s of back-off meant for a crash loop. Unset in production.
RESTART_DELAY_ENV = "SKYRL_TX_TEST_ENGINE_RESTART_DELAY_S"
STABLE_AFTER_S = 60.0  # an engine that ran this long resets the back-off
# Tests only: the first engine process starts once this file exists, so a test can observe the server while its
# engine has not recovered yet (tests/api/test_restart_serves_at_once.py). Unset in production.
START_GATE_ENV = "SKYRL_TX_TEST_ENGINE_START_GATE"
DONE = "done "
STATS = "stats "
PROGRESS = "progress "  # streaming samples' new tokens: [[future id, [[tokens of sample 0], ...]], ...]


def done_line(outcomes: list[FutureOutcome]) -> str:
    """The engine's report of finished futures (one line: json.dumps escapes newlines)."""
    return DONE + json.dumps([outcome_to_json(o) for o in outcomes])  # binary results stay in the database


def parse_done_line(line: str) -> list[FutureOutcome]:
    return [outcome_from_json(fields) for fields in json.loads(line[len(DONE):])]


class PipeEvents:
    """The engine child's side of the protocol: a Notify that writes `done` lines, and the `report_stats` sink
    that EngineStats finds on it (engine/stats.py) for `stats` lines. Both are called on the engine thread."""

    def __init__(self, write_line: Callable[[str], None]) -> None:
        self._write_line = write_line

    def __call__(self, outcomes: list[FutureOutcome]) -> None:
        self._write_line(done_line(outcomes))

    def report_stats(self, stats: dict[str, Any]) -> None:
        self._write_line(STATS + json.dumps(stats))

    def report_progress(self, items: list[tuple[str, list[list[int]]]]) -> None:
        self._write_line(PROGRESS + json.dumps(items))


class EngineProcess:
    """Same face as EngineRunner: start(), wake(), stop(), ready, failed, pid. `on_finished` may also have a
    `report_stats(dict)` method: it gets the engine's `stats` lines (api/metrics.py)."""

    def __init__(self, settings_json: str, on_finished: Notify = lambda outcomes: None):
        self._argv = [sys.executable, "-m", "skyrl_tx.engine", "--stdio"]  # settings go through stdin, never here
        self._settings_line = settings_json.encode() + b"\n"  # json.dumps escapes newlines: one line
        self._on_finished = on_finished
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._stopping = False
        self.ready = threading.Event()
        self.failed: BaseException | None = None
        self.restarts = 0

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def start(self) -> None:
        threading.Thread(target=self._supervise, name="skyrl-tx-engine-supervisor", daemon=True).start()

    def wake(self) -> None:
        with self._lock:
            process = self._process
            if process is None or process.stdin is None:
                return
            try:
                process.stdin.write(b"\n")
                process.stdin.flush()
            except (BrokenPipeError, ValueError, OSError):  # dying: the restarted engine reads the database
                pass

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        with self._lock:
            process = self._process
            if process is not None and process.stdin is not None:
                try:
                    process.stdin.close()  # the engine finishes its step and exits
                except OSError:
                    pass
        if process is not None:
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def _supervise(self) -> None:
        gate = os.environ.get(START_GATE_ENV)
        while gate and not os.path.exists(gate) and not self._stopping:
            time.sleep(0.05)
        crashes = 0
        while not self._stopping:
            started = time.monotonic()
            with self._lock:  # the settings line goes first: wake() writes only under this lock
                self._process = subprocess.Popen(self._argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
                self._send_settings(self._process)
            process = self._process
            log.info("engine process %d started", process.pid)
            self._read_events(process)
            code = process.wait()
            if self._stopping:
                return
            if not self.ready.is_set():  # never came up: a configuration problem, not a crash to retry
                self.failed = RuntimeError(f"the engine process exited with code {code} during start-up "
                                           "(see the log above)")
                self.ready.set()
                return
            crashes = 0 if time.monotonic() - started > STABLE_AFTER_S else crashes + 1
            delay = RESTART_DELAYS_S[min(crashes, len(RESTART_DELAYS_S)) - 1] if crashes else RESTART_DELAYS_S[0]
            if os.environ.get(RESTART_DELAY_ENV):
                delay = float(os.environ[RESTART_DELAY_ENV])
            log.error("engine process %d exited with code %s; restarting in %.1fs (pending requests are kept)",
                      process.pid, code, delay)
            self.restarts += 1
            time.sleep(delay)

    def _send_settings(self, process: subprocess.Popen[bytes]) -> None:
        assert process.stdin is not None
        try:
            process.stdin.write(self._settings_line)
            process.stdin.flush()
        except (BrokenPipeError, OSError):  # died at once: _supervise reports its exit code
            log.error("engine process %d exited before it read its settings", process.pid)

    def _read_events(self, process: subprocess.Popen[bytes]) -> None:
        assert process.stdout is not None
        for raw in process.stdout:
            line = raw.decode(errors="replace").strip()
            if line == "ready":
                self.ready.set()
            elif line.startswith(DONE):
                try:
                    outcomes = parse_done_line(line)
                except (ValueError, TypeError):  # the long-polls still find the results in the database
                    log.exception("engine process: unreadable report %.200s", line)
                    continue
                self._on_finished(outcomes)
            elif line.startswith(PROGRESS):
                report_progress = getattr(self._on_finished, "report_progress", None)
                if report_progress is not None:
                    try:
                        report_progress([(fid, tokens) for fid, tokens in json.loads(line[len(PROGRESS):])])
                    except (ValueError, TypeError):  # the stream still gets the whole result at the end
                        log.warning("engine process: unreadable progress %.200s", line)
            elif line.startswith(STATS):
                report_stats = getattr(self._on_finished, "report_stats", None)
                if report_stats is not None:
                    try:
                        report_stats(json.loads(line[len(STATS):]))
                    except ValueError:
                        log.warning("engine process: unreadable stats %.200s", line)
