"""TraceJobs: builds session traces in the background, one at a time per session, and keeps the newest few in
memory for their signed download URLs.

The SDK polls GET .../trace_export every 5 s: the first call starts a build and answers "pending"; once built it
answers "ready" with a signed URL (an hour, as checkpoint downloads: api/url_signing.py's secret); a build that
raised answers "failed" with its message once, and the next call starts again. A trace is rebuilt only when the
session's requests changed since it was built (their count, and the newest stored and finished times).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Literal

from skyrl_tx.api.trace.build import BuiltTrace
from skyrl_tx.api.url_signing import sign, sign_matches

log = logging.getLogger("skyrl_tx.api")

MAX_KEPT = 16  # sessions whose built trace stays downloadable (oldest dropped first)
MAX_SPANS = 20_000  # requests drawn per trace (the newest): 20,000 made an 8 MB file in 3.7 s here (2 busy cores)
URL_LIFETIME_S = 3600

Status = Literal["pending", "ready", "failed"]


@dataclass
class TraceJob:
    version: tuple[object, ...]
    build_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    status: Status = "pending"
    trace: BuiltTrace | None = None
    error: str | None = None


class TraceJobs:
    def __init__(self, max_kept: int = MAX_KEPT) -> None:
        self.max_kept = max_kept
        self._jobs: dict[str, TraceJob] = {}
        self._lock = threading.Lock()

    def poll(self, session_id: str, version: tuple[object, ...], build: Callable[[], BuiltTrace]) -> TraceJob:
        """The session's job as it is now (a copy): the ready one if still up to date, the one building, or a new
        build started (pending, however fast it then goes: the SDK's first poll is answered pending)."""
        with self._lock:
            job = self._jobs.get(session_id)
            if job is not None and job.status == "failed":
                del self._jobs[session_id]  # reported once (this answer); the next poll builds again
                return replace(job)
            if job is not None and (job.status == "pending" or job.version == version):
                return replace(job)
            job = self._jobs[session_id] = TraceJob(version)
            while len(self._jobs) > self.max_kept:
                del self._jobs[next(iter(self._jobs))]
            answer = replace(job)
        threading.Thread(target=self._run, args=(session_id, job, build), name=f"trace-{session_id}",
                         daemon=True).start()
        return answer

    def _run(self, session_id: str, job: TraceJob, build: Callable[[], BuiltTrace]) -> None:
        started = time.perf_counter()
        try:
            trace = build()
        except Exception as exc:  # noqa: BLE001 - reported to the client as the job's failure
            log.exception("trace export of session %s failed", session_id)
            with self._lock:
                job.error, job.status = f"building the trace failed: {type(exc).__name__}: {exc}", "failed"
            return
        with self._lock:
            job.trace, job.status = trace, "ready"
        log.info("trace export of session %s: %d of %d requests, %d bytes in %.2f s%s", session_id, trace.spans,
                 trace.total, len(trace.data), time.perf_counter() - started,
                 f" (truncated to the newest {trace.spans})" if trace.truncated else "")

    def ready(self, session_id: str, build_id: str) -> BuiltTrace | None:
        with self._lock:
            job = self._jobs.get(session_id)
        return job.trace if job is not None and job.build_id == build_id and job.status == "ready" else None


def _message(session_id: str, build_id: str, expires: int, key_id: str) -> str:
    return f"trace-export/{session_id}/{build_id}/{expires}/{key_id}"  # never a checkpoint URL's shape


def signature(secret: bytes, session_id: str, build_id: str, expires: int, key_id: str) -> str:
    """Signed as checkpoint URLs are (api/url_signing.py), under a message of its own."""
    return sign(secret, _message(session_id, build_id, expires, key_id))


def signature_matches(secret: bytes, session_id: str, build_id: str, expires: int, key_id: str, sig: str) -> bool:
    return sign_matches(secret, _message(session_id, build_id, expires, key_id), sig)
