"""GET /api/v1/audit (the SDK's AdminClient.get_audit_log): one UTC day of audit entries the caller may see, oldest
first, paged by an id cursor. The entries are written with the actions they record (db/audit.py)."""

from __future__ import annotations

from datetime import date, datetime, time, timedelta, timezone
from typing import Any, Literal

from fastapi import APIRouter
from pydantic import BaseModel, Field
from sqlalchemy import or_, select

from skyrl_tx.api.deps import DbDep
from skyrl_tx.api.principal import CallerDep, Principal
from skyrl_tx.api.responses import COMMON_ERRORS, errors
from skyrl_tx.api.routes.training_runs import OWNER
from skyrl_tx.db.audit import EVENTS
from skyrl_tx.db.models import AuditRecord
from skyrl_tx.errors import InvalidArgumentError

router = APIRouter(prefix="/api/v1")
MAX_LIMIT = 10_000
EventType = Literal["all", "checkpoints", "projects", "teams", "organizations", "models"]
A = AuditRecord


class AuditLogEntry(BaseModel):
    """The SDK's AuditLogEntry."""

    timestamp: datetime
    event: str = Field(description="<resource>_<action>: model_create, model_unload, checkpoint_save, "
                                   "checkpoint_delete, checkpoint_publish, checkpoint_unpublish, checkpoint_ttl_set, "
                                   "session_project_set, key_create, key_revoke")
    event_details: dict[str, Any] = Field(description="actor (the key that acted; 'local' under --auth none, "
                                                      "'operator' for the skyrl-tx keys command), owner, resource, "
                                                      "request_id, and the event's own fields")
    model_id: str | None = None
    tinker_path: str | None = None


class AuditLogResponse(BaseModel):
    """The SDK's AuditLogResponse, and the cursor of the next page (the SDK reads the first page only)."""

    entries: list[AuditLogEntry]
    next_after_id: int | None = Field(description="more entries this day: ask again with after_id=<this>")


def _visible(who: Principal) -> Any:
    """An admin (and --auth none) sees every entry; a key those about its own objects or its own actions."""
    if who.admin:
        return None
    return or_(A.owner_key_id == who.key_id, A.actor_key_id == who.key_id)


def _entry(row: AuditRecord) -> AuditLogEntry:
    actor = row.actor_key_id or (OWNER if row.event not in ("key_create", "key_revoke") else "operator")
    details = {**row.details, "actor": actor, "owner": row.owner_key_id or OWNER, "resource": row.resource,
               "request_id": row.request_id}
    checkpoint = row.event.startswith("checkpoint_")
    return AuditLogEntry(timestamp=row.created_at, event=row.event, event_details=details,
                         model_id=row.details.get("model_id") if checkpoint else None,
                         tinker_path=row.details.get("tinker_path") if checkpoint else None)


@router.get("/audit", responses={**COMMON_ERRORS, **errors(400)})
def audit_log(db: DbDep, who: CallerDep, event_type: EventType = "all", day: date | None = None,
              limit: int = 1000, after_id: int = 0) -> AuditLogResponse:
    """Entries of `day` (UTC midnight to midnight; default today) in `event_type`'s group, at most `limit` (1-10000)
    after entry `after_id`."""
    if not 1 <= limit <= MAX_LIMIT or not 0 <= after_id < 2**63:
        raise InvalidArgumentError(f"audit: limit must be in [1, {MAX_LIMIT}] and after_id >= 0 (got limit={limit}, "
                                   f"after_id={after_id}); page on with the last answer's next_after_id")
    day = day or datetime.now(timezone.utc).date()
    try:
        start = datetime.combine(day, time(), timezone.utc)
        end = start + timedelta(days=1)
    except OverflowError as exc:
        raise InvalidArgumentError(f"audit: day {day.isoformat()} is out of range; give a date such as "
                                   "2026-01-15") from exc
    query = select(A).where(A.created_at >= start, A.created_at < end, A.id > after_id)
    if event_type != "all":
        query = query.where(A.event.in_([e for e, group in EVENTS.items() if group == event_type] or [""]))
    visible = _visible(who)
    if visible is not None:
        query = query.where(visible)
    rows = db.scalars(query.order_by(A.id).limit(limit + 1)).all()
    more = len(rows) > limit
    rows = rows[:limit]
    return AuditLogResponse(entries=[_entry(r) for r in rows], next_after_id=rows[-1].id if more else None)
