"""The session trace export's HTTP side: trace_export (start or poll a build; session_info.py routes to it), the
signed download of a built trace, and GET /api/v1/sessions/{id}/request_timings (every request's phase times as
JSON: bench latency reads it)."""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any, Literal

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, Field
from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session

from skyrl_tx.api.deps import DbDep
from skyrl_tx.api.ownership import owned_session
from skyrl_tx.api.principal import CallerDep, Principal
from skyrl_tx.api.responses import COMMON_ERRORS, errors
from skyrl_tx.api.trace.build import BuiltTrace, build_trace, phase_points
from skyrl_tx.api.trace.jobs import MAX_SPANS, URL_LIFETIME_S, TraceJobs, signature, signature_matches
from skyrl_tx.api.trace.ring import ApiTimes, RequestTimings, ring_of
from skyrl_tx.db.models import ApiKeyRecord, FutureRecord, ModelRecord
from skyrl_tx.db.request_timings import session_request_timings, training_tokens
from skyrl_tx.errors import InvalidArgumentError, NotFoundError

router = APIRouter(prefix="/api/v1")
F = FutureRecord.__table__
FILE_PREFIX = "/api/v1/trace_files/"  # open without an API key (api/auth.py OPEN_PREFIXES): the signature is its key
MAX_TIMINGS = 10_000  # requests per request_timings answer (the newest)


class TraceExportResponse(BaseModel):
    """The SDK's trace_export poll answer (status, url, error), and what the built trace holds."""

    status: Literal["pending", "ready", "failed"]
    url: str | None = Field(None, description="ready: a signed download URL of the .pftrace, valid for an hour")
    error: str | None = Field(None, description="failed: why (the next call builds again)")
    requests: int | None = Field(None, description="ready: the requests drawn (one span each)")
    total_requests: int | None = Field(None, description="ready: the session's requests (more where truncated)")
    truncated: bool | None = Field(None, description=f"ready: only the newest {MAX_SPANS} requests are drawn")


def _version(db: Session, session_id: str) -> tuple[object, ...]:
    """What a built trace is up to date with: the session's request count and newest stored and finished times."""
    models = select(ModelRecord.id).where(ModelRecord.session_id == session_id).scalar_subquery()
    row = db.execute(select(func.count(), func.max(F.c.created_at), func.max(F.c.completed_at))
                     .where(or_(F.c.session_id == session_id, F.c.model_id.in_(models)))).one()
    return tuple(row)


def _ring(request: Request) -> RequestTimings:
    ring = ring_of(request.app)
    return ring if ring is not None else RequestTimings(1)


def trace_export(request: Request, db: Session, session_id: str, who: Principal) -> TraceExportResponse:
    """For a session the caller sees (checked by the route)."""
    jobs: TraceJobs = request.app.state.trace_jobs
    database, ring = request.app.state.database, _ring(request)

    def build() -> BuiltTrace:
        with database.connect() as conn:
            rows, total = session_request_timings(conn, session_id, MAX_SPANS)
            tokens = training_tokens(conn, [r.future_id for r in rows if r.request_type in
                                            ("forward_backward", "forward")])
        return build_trace(session_id, rows, total, ring.get, tokens)

    job = jobs.poll(session_id, _version(db, session_id), build)
    if job.status == "failed":
        return TraceExportResponse(status="failed", error=job.error)
    if job.status == "pending" or job.trace is None:
        return TraceExportResponse(status="pending")
    expires = int(time.time()) + URL_LIFETIME_S
    key_id = who.key_id or ""
    sig = signature(request.app.state.download_secret, session_id, job.build_id, expires, key_id)
    base = request.app.state.settings.public_base_url()  # never the request's Host header: a client could set it
    url = f"{base}{FILE_PREFIX}{session_id}.pftrace?build={job.build_id}&expires={expires}&key={key_id}&sig={sig}"
    return TraceExportResponse(status="ready", url=url, requests=job.trace.spans, total_requests=job.trace.total,
                               truncated=job.trace.truncated)


@router.get(FILE_PREFIX.removeprefix("/api/v1") + "{name}", response_class=Response, responses={
    200: {"description": "the .pftrace (a Perfetto trace: open it in ui.perfetto.dev)", "content": {
        "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}, **errors(400, 404, 500)})
def download_trace(name: str, build: str, expires: int, sig: str, request: Request, db: DbDep,
                   key: str = "") -> Response:
    """A signed URL from trace_export. Like checkpoint downloads, the key it was issued to is checked again: revoked,
    and the URL stops working before it expires."""
    session_id = name.removesuffix(".pftrace")
    if not signature_matches(request.app.state.download_secret, session_id, build, expires, key, sig) \
            or expires < time.time():
        raise InvalidArgumentError("trace download: the URL's signature is invalid or expired; request a new URL "
                                   "(tinker session export-trace, or GET /api/v1/sessions/{id}/trace_export)")
    if key:
        issued_to = db.get(ApiKeyRecord, key)
        if issued_to is None or issued_to.revoked_at is not None:
            raise NotFoundError("trace download: the API key this URL was issued to was revoked; request a new URL "
                                "with a valid key")
        owned_session(db, session_id, Principal(issued_to.id, issued_to.name, issued_to.admin),
                      "trace download: the session was not found")
    trace = request.app.state.trace_jobs.ready(session_id, build)
    if trace is None:
        raise NotFoundError("trace download: this trace is no longer kept (the session's requests changed since, or "
                            "the server restarted); request a new URL")
    return Response(trace.data, media_type="application/octet-stream",
                    headers={"Content-Disposition": f'attachment; filename="{session_id}.pftrace"'})


class RequestPhases(BaseModel):
    future_id: str
    request_type: str
    client_kind: str = Field(description="training | sampling | session")
    client_id: str = Field(description="the model id, the sampling session id, or the session id")
    seq_id: int | None
    status: str
    times: dict[str, datetime | None] = Field(description="received, stored, ordered, claimed, computed, "
                                              "completed, woken, answered (None: not recorded)")
    phases_s: dict[str, float] = Field(description="each phase's seconds, in order (api/trace/build.py PHASES)")


class RequestTimingsResponse(BaseModel):
    requests: list[RequestPhases]
    total_requests: int


def _utc(t: float | None) -> datetime | None:
    from datetime import timezone

    return datetime.fromtimestamp(t, timezone.utc) if t is not None else None


@router.get("/sessions/{session_id}/request_timings", responses={**COMMON_ERRORS, **errors(400, 404)})
def request_timings(session_id: str, request: Request, db: DbDep, who: CallerDep,
                    limit: int = MAX_TIMINGS) -> RequestTimingsResponse:
    """The session's newest `limit` (1-10000) requests, oldest first, with the phase times the trace export draws."""
    if not 1 <= limit <= MAX_TIMINGS:
        raise InvalidArgumentError(f"request_timings: limit must be 1 to {MAX_TIMINGS} (got {limit})")
    owned_session(db, session_id, who, f"request_timings: session {session_id!r} not found (another API key's "
                                       "sessions are not found either); list yours with list_sessions")
    ring = _ring(request)
    rows, total = session_request_timings(db.connection(), session_id, limit)
    out = []
    for r in rows:
        api: ApiTimes = ring.get(r.future_id)
        times = {"received": _utc(api.received), "stored": r.stored, "ordered": r.ordered, "claimed": r.claimed,
                 "computed": r.computed, "completed": r.completed, "woken": _utc(api.woken),
                 "answered": _utc(api.answered)}
        phases: dict[str, Any] = {}
        for name, begin, end in phase_points(r, api):
            phases[name] = phases.get(name, 0.0) + (end - begin) / 1e9
        out.append(RequestPhases(future_id=r.future_id, request_type=r.request_type, client_kind=r.client_kind,
                                 client_id=r.client_id, seq_id=r.seq_id, status=r.status, times=times,
                                 phases_s=phases))
    return RequestTimingsResponse(requests=out, total_requests=total)
