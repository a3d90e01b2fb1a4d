"""The RestClient's session routes: list_sessions, get_session (models, sampling clients, last heartbeat),
assign_session_project, and export_session_trace (a Perfetto trace of the session's requests: api/trace/)."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Literal

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import func, select

from skyrl_tx.api.deps import DbDep
from skyrl_tx.api.ownership import owned_session
from skyrl_tx.api.principal import CallerDep, Principal
from skyrl_tx.api.request_ids import REQUEST_ID
from skyrl_tx.api.responses import BODY_ERRORS, COMMON_ERRORS, Cursor, errors
from skyrl_tx.api.routes.training_runs import DEFAULT_PROJECT, OWNER, page_bounds
from skyrl_tx.api.trace.export import TraceExportResponse, trace_export
from skyrl_tx.db import audit
from skyrl_tx.db.models import ModelRecord, SamplingSessionRecord, SessionRecord, SessionStatus
from skyrl_tx.errors import InvalidArgumentError

router = APIRouter(prefix="/api/v1")
PATH_ERRORS = {**COMMON_ERRORS, **errors(400, 404)}
MAX_PROJECT_ID_CHARS = 256

AccessScope = Literal["owned", "accessible"]


class ListSessionsResponse(BaseModel):
    """The SDK's ListSessionsResponse (session ids, newest first) and the page it is."""

    sessions: list[str]
    cursor: Cursor


class GetSessionResponse(BaseModel):
    """The SDK's GetSessionResponse, and what else this server knows of the session (the SDK ignores the rest)."""

    training_run_ids: list[str] = Field(description="its models (training clients), oldest first, every state")
    sampler_ids: list[str] = Field(description="its sampling clients (sampling sessions), oldest first")
    user_metadata: dict[str, str] | None = None
    display_name: str | None = None
    session_id: str
    owner: str = Field(description="the API key id that created it; 'local' under --auth none")
    project_id: str
    status: str = Field(description="active, or ended (finished by its client, or silent past the session timeout)")
    finish_reason: str | None = Field(description="success | errored | interrupted, as its client's close() said")
    created_at: datetime
    last_heartbeat_at: datetime


class AssignProjectRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    project_id: str | None = None


def _owned_by(who: Principal, scope: AccessScope) -> Any:
    """Whose sessions a list shows: the caller's own ("owned"), or every one it may see ("accessible": an admin's
    is every key's; another key's is its own)."""
    if scope == "accessible" and who.admin:
        return None
    return SessionRecord.owner_key_id.is_(None) if who.key_id is None else SessionRecord.owner_key_id == who.key_id


@router.get("/sessions", responses={**COMMON_ERRORS, **errors(400)})
def list_sessions(db: DbDep, who: CallerDep, limit: int = 20, offset: int = 0,
                  access_scope: AccessScope = "owned") -> ListSessionsResponse:
    """Session ids, newest first, paged by limit (1-1000) and offset."""
    limit, offset = page_bounds(limit, offset)
    query = select(SessionRecord.id)
    where = _owned_by(who, access_scope)
    if where is not None:
        query = query.where(where)
    total = db.scalar(select(func.count()).select_from(query.subquery())) or 0
    ids = db.scalars(query.order_by(SessionRecord.created_at.desc(), SessionRecord.id.desc())
                     .limit(limit).offset(offset)).all()
    return ListSessionsResponse(sessions=list(ids), cursor=Cursor(offset=offset, limit=limit, total_count=total))


def _session(db: DbDep, session_id: str, who: Principal, what: str) -> SessionRecord:
    return owned_session(db, session_id, who, f"{what}: session {session_id!r} not found (another API key's sessions "
                                              "are not found either); list yours with list_sessions")


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


@router.get("/sessions/{session_id}", responses=PATH_ERRORS)
def get_session(session_id: str, db: DbDep, who: CallerDep,
                access_scope: AccessScope = "owned") -> GetSessionResponse:
    """A session the caller may see (its own; an admin's: any), whatever access_scope says."""
    row = _session(db, session_id, who, "get_session")
    runs = db.scalars(select(ModelRecord.id).where(ModelRecord.session_id == session_id)
                      .order_by(ModelRecord.created_at, ModelRecord.id)).all()
    samplers = db.scalars(select(SamplingSessionRecord.id).where(SamplingSessionRecord.session_id == session_id)
                          .order_by(SamplingSessionRecord.created_at, SamplingSessionRecord.id)).all()
    metadata = {str(k): _text(v) for k, v in (row.user_metadata or {}).items()} or None
    return GetSessionResponse(
        training_run_ids=list(runs), sampler_ids=list(samplers), user_metadata=metadata, display_name=row.display_name,
        session_id=row.id, owner=row.owner_key_id or OWNER, project_id=row.project_id or DEFAULT_PROJECT,
        status="active" if row.status == SessionStatus.ACTIVE.value else "ended", finish_reason=row.finish_reason,
        created_at=row.created_at, last_heartbeat_at=row.last_heartbeat_at)


@router.put("/sessions/{session_id}/project", status_code=204, responses={**BODY_ERRORS, **errors(404)})
def assign_session_project(session_id: str, body: AssignProjectRequest, db: DbDep, who: CallerDep) -> Response:
    """Moves the session (and so its training runs and samplers) into project `project_id`. Projects are names:
    any non-empty one is created by its first use. There is no moving out of a project (the SDK's rule), only into
    another."""
    project = (body.project_id or "").strip()
    if not project or len(project) > MAX_PROJECT_ID_CHARS:
        raise InvalidArgumentError(f"assign_session_project: project_id must be a non-empty name of at most "
                                   f"{MAX_PROJECT_ID_CHARS} characters (got {body.project_id!r}); send "
                                   '{"project_id": "<name>"}')
    row = _session(db, session_id, who, "assign_session_project")
    previous = row.project_id or DEFAULT_PROJECT
    row.project_id = project
    audit.record(db, "session_project_set", actor=who.key_id, owner=row.owner_key_id, resource=session_id,
                 request_id=REQUEST_ID.get(), details={"session_id": session_id, "project_id": project,
                                                       "previous_project_id": previous})
    db.commit()
    return Response(status_code=204)


@router.get("/sessions/{session_id}/trace_export", responses=PATH_ERRORS)
def export_session_trace(session_id: str, request: Request, db: DbDep, who: CallerDep) -> TraceExportResponse:
    """A Perfetto trace (.pftrace) of a session the caller sees (a 404 otherwise), built in the background: "pending"
    until built (the SDK polls), then "ready" with a signed download URL, or "failed" with why. One track per
    training and sampling client, a span per request split into its phases, counters of requests in flight,
    tokens/s and request sizes (api/trace/build.py)."""
    _session(db, session_id, who, "export_session_trace")
    return trace_export(request, db, session_id, who)
