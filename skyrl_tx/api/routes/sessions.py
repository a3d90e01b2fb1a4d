"""sessions/search: a caller's sessions, newest first, filtered, paged by a keyset cursor (search_sessions)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter
from pydantic import AwareDatetime, BaseModel, ConfigDict, Field
from sqlalchemy import ColumnElement, and_, false, func, or_, select, true
from sqlalchemy.orm import Session

from skyrl_tx.api.deps import DbDep
from skyrl_tx.api.principal import CallerDep, Principal
from skyrl_tx.api.responses import BODY_ERRORS, SessionSearchResponse
from skyrl_tx.api.routes.training_runs import OWNER
from skyrl_tx.db.models import CheckpointRecord, CheckpointStatus, ModelRecord, SessionRecord, SessionStatus

router = APIRouter(prefix="/api/v1")

DEFAULT_PROJECT = "default"  # the project of a session created without one (this server keeps no project list)
SCAN_BATCH = 200  # rows read per step while filters the database cannot apply (metadata, name words) drop some


# The SDK's search types (tinker/types/session_search_request.py and its parts). Unknown fields are refused, not
# ignored: a filter this server did not apply would return sessions the caller asked to leave out.
class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SessionSearchCursor(Strict):
    last_created_at: AwareDatetime
    last_session_id: str


class OwnOwner(Strict):
    type: Literal["own"] = "own"


class AccessibleOwner(Strict):
    type: Literal["accessible"]


class UserOwner(Strict):
    type: Literal["user"]
    owner_urns: list[str] = Field(min_length=1, max_length=10)  # the `owner` of a SessionSummary: a key id or "local"


class ActiveQuery(Strict):
    type: Literal["active"]


class CancelledQuery(Strict):
    type: Literal["cancelled"]


class FailedQuery(Strict):
    type: Literal["failed"]


class ClientFinishedQuery(Strict):
    type: Literal["client_finished"]
    reasons: list[Literal["success", "errored", "interrupted"]] | None = Field(default=None, min_length=1)


class SessionSearchRequest(Strict):
    session_id: str | None = None
    project_ids: list[str] | None = None
    user_metadata: dict[str, str] = Field(default_factory=dict)
    display_name: str | None = Field(default=None, min_length=1)
    owner: Annotated[OwnOwner | AccessibleOwner | UserOwner, Field(discriminator="type")] = OwnOwner()
    statuses: list[Annotated[ActiveQuery | CancelledQuery | FailedQuery | ClientFinishedQuery,
                             Field(discriminator="type")]] | None = Field(default=None, min_length=1)
    limit: int = Field(default=50, ge=1, le=200)
    cursor: SessionSearchCursor | None = None


S = SessionRecord


def _owned_by(key_id: str | None) -> ColumnElement[bool]:
    return S.owner_key_id.is_(None) if key_id is None else S.owner_key_id == key_id


def _owner_filter(owner: OwnOwner | AccessibleOwner | UserOwner, who: Principal) -> ColumnElement[bool]:
    """Whose sessions: the caller's own; every one it may see (an admin: all; another key: its own); or the named
    owners among those it may see (a non-admin naming others finds nothing of theirs, as with every 404)."""
    own = _owned_by(who.key_id)
    if isinstance(owner, OwnOwner):
        return own
    if isinstance(owner, AccessibleOwner):
        return true() if who.admin else own
    named = or_(*[_owned_by(None if urn == OWNER else urn) for urn in owner.owner_urns])
    return named if who.admin else and_(named, own)


def _status_filter(queries: list[Any]) -> ColumnElement[bool]:
    clauses = []
    for query in queries:
        if isinstance(query, ActiveQuery):
            clauses.append(S.status == SessionStatus.ACTIVE.value)
        elif isinstance(query, ClientFinishedQuery):
            clauses.append(S.finish_reason.in_(query.reasons) if query.reasons else S.finish_reason.is_not(None))
        # cancelled, failed: this server never cancels or fails a session, so those match nothing
    return or_(false(), *clauses)


def _text(value: Any) -> str:
    """A user_metadata value as SessionSummary carries it (a string): strings as they are, other JSON as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


def _matches(row: SessionRecord, body: SessionSearchRequest) -> bool:
    """The filters applied here rather than in SQL: metadata pairs (JSON columns compare differently per database)
    and name words (case-insensitive beyond ASCII, which SQLite's lower() is not)."""
    if body.display_name is not None:
        name = (row.display_name or "").casefold()
        words = body.display_name.casefold().split() or [body.display_name.casefold()]
        if not (row.id == body.session_id or all(word in name for word in words)):
            return False
    metadata = row.user_metadata or {}
    return all(key in metadata and _text(metadata[key]) == value for key, value in body.user_metadata.items())


def _candidates(db: Session, body: SessionSearchRequest, who: Principal) -> Iterator[SessionRecord]:
    """Sessions passing the SQL filters, newest first (created_at, then id, both descending), from the cursor on."""
    query = select(S).where(_owner_filter(body.owner, who))
    if body.project_ids is not None:
        query = query.where(func.coalesce(S.project_id, DEFAULT_PROJECT).in_(body.project_ids))
    if body.statuses is not None:
        query = query.where(_status_filter(body.statuses))
    if body.session_id is not None and body.display_name is None:  # with a name, either one matches (_matches)
        query = query.where(S.id == body.session_id)
    after: tuple[datetime, str] | None = None
    if body.cursor is not None:
        after = (body.cursor.last_created_at, body.cursor.last_session_id)
    while True:
        page = query
        if after is not None:
            page = page.where(or_(S.created_at < after[0], and_(S.created_at == after[0], S.id < after[1])))
        rows = db.scalars(page.order_by(S.created_at.desc(), S.id.desc()).limit(SCAN_BATCH)).all()
        yield from rows
        if len(rows) < SCAN_BATCH:
            return
        after = (rows[-1].created_at, rows[-1].id)


def _checkpoint_totals(db: Session, session_ids: list[str]) -> dict[str, tuple[int, int]]:
    """(count, bytes) of each session's listed (ready) checkpoints."""
    size = func.coalesce(func.sum(CheckpointRecord.size_bytes), 0)
    rows = db.execute(
        select(ModelRecord.session_id, func.count(CheckpointRecord.id), size)
        .join(ModelRecord, ModelRecord.id == CheckpointRecord.model_id)
        .where(ModelRecord.session_id.in_(session_ids), CheckpointRecord.status == CheckpointStatus.READY.value)
        .group_by(ModelRecord.session_id))
    return {session_id: (int(count), int(size)) for session_id, count, size in rows}


def _status_json(row: SessionRecord) -> dict[str, Any] | None:
    if row.finish_reason is not None:
        return {"type": "client_finished", "reason": {"type": row.finish_reason}, "detail": row.finish_detail}
    if row.status == SessionStatus.ACTIVE.value:
        return {"type": "active"}
    return None  # ended by the session timeout: neither finished by its client nor running


def _summary(row: SessionRecord, totals: tuple[int, int]) -> dict[str, Any]:
    metadata = {str(k): _text(v) for k, v in (row.user_metadata or {}).items()} or None
    return {"session_id": row.id, "created_at": row.created_at.isoformat(), "owner": row.owner_key_id or OWNER,
            "project_id": row.project_id or DEFAULT_PROJECT, "status": _status_json(row),
            "checkpoints_count": totals[0], "checkpoint_storage_bytes": totals[1],
            "display_name": row.display_name, "user_metadata": metadata}


@router.post("/sessions/search", responses=BODY_ERRORS)
def search_sessions(body: SessionSearchRequest, db: DbDep, who: CallerDep) -> SessionSearchResponse:
    found: list[SessionRecord] = []
    for row in _candidates(db, body, who):
        if _matches(row, body):
            found.append(row)
            if len(found) > body.limit:  # one more than a page: there is a next page
                break
    page = found[:body.limit]
    totals = _checkpoint_totals(db, [row.id for row in page]) if page else {}
    next_cursor = None
    if len(found) > body.limit:
        last = page[-1]
        next_cursor = {"last_created_at": last.created_at.isoformat(), "last_session_id": last.id}
    return SessionSearchResponse.model_validate(
        {"sessions": [_summary(row, totals.get(row.id, (0, 0))) for row in page], "next_cursor": next_cursor})
