"""The audit log's writes: one row per accepted action, added to the caller's transaction (so a rolled-back action,
e.g. an idempotent retry, leaves no entry), and the event names with the SDK's event_type groups."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import Connection, insert
from sqlalchemy.orm import Session

from skyrl_tx.db.models import AuditRecord

AUDIT = AuditRecord.__table__

# event -> the SDK's AdminClient.get_audit_log(event_type=...) group it belongs to ("all" takes every one). Keys are
# the organisation's here (there are no teams); models and sessions have groups of their own.
EVENTS = {
    "model_create": "models", "model_unload": "models",
    "checkpoint_save": "checkpoints", "checkpoint_delete": "checkpoints", "checkpoint_publish": "checkpoints",
    "checkpoint_unpublish": "checkpoints", "checkpoint_ttl_set": "checkpoints",
    "session_project_set": "projects",
    "key_create": "organizations", "key_revoke": "organizations",
}
GROUPS = ("all", "checkpoints", "projects", "teams", "organizations", "models")


def audit_row(event: str, *, actor: str | None, owner: str | None, resource: str, details: dict[str, Any] | None = None,
              request_id: str | None = None) -> dict[str, Any]:
    """The row's values (for record() or a Core insert of AUDIT)."""
    if event not in EVENTS:
        raise ValueError(f"unknown audit event {event!r}")  # a programming error: every event has a group
    return {"created_at": datetime.now(timezone.utc), "event": event, "actor_key_id": actor, "owner_key_id": owner,
            "resource": resource, "details": details or {}, "request_id": request_id}


def record(db: Session | Connection, event: str, **fields: Any) -> None:
    """Adds the entry in `db`'s open transaction; the caller commits it with its action."""
    db.execute(insert(AUDIT), audit_row(event, **fields))
