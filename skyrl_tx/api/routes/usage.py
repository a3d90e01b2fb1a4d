"""Usage per key in the SDK's billing shapes (AdminClient.get_billing_usage, get_current_checkpoint_storage_usage):
tokens trained, prefilled and sampled, and checkpoints saved, per UTC hour; checkpoint bytes stored now. Read from
what the server keeps anyway (finished futures, checkpoints): nothing is counted on the request path."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

from fastapi import APIRouter, Request
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from skyrl_tx.api.deps import DbDep
from skyrl_tx.api.principal import CallerDep, Principal
from skyrl_tx.api.responses import COMMON_ERRORS, errors
from skyrl_tx.api.routes.training_runs import DEFAULT_PROJECT, OWNER
from skyrl_tx.api.routes.usage_schemas import BillingUsageResponse, CurrentCheckpointStorageUsageResponse
from skyrl_tx.db.models import (ApiKeyRecord, CheckpointRecord, CheckpointStatus, FutureRecord, FutureStatus,
                                ModelRecord, SessionRecord)
from skyrl_tx.db.request_timings import input_tokens
from skyrl_tx.errors import InvalidArgumentError

router = APIRouter(prefix="/api/v1")
MAX_WINDOW = timedelta(days=14)  # the SDK's documented bound
BYTES_PER_GB = 10**9  # the storage unit of size_gigabytes: decimal gigabytes
HOUR = timedelta(hours=1)
F, M, S = FutureRecord.__table__, ModelRecord.__table__, SessionRecord.__table__
TRAINING = ("forward", "forward_backward")
_OWNER = func.coalesce(M.c.owner_key_id, S.c.owner_key_id)
_SESSION = func.coalesce(M.c.session_id, F.c.session_id)
SAVED = (CheckpointStatus.READY.value, CheckpointStatus.DELETED.value)  # written completely (deleted since or not)


def _utc(value: datetime, field: str) -> datetime:
    value = value if value.tzinfo is not None else value.replace(tzinfo=timezone.utc)
    try:
        value = value.astimezone(timezone.utc)
    except OverflowError as exc:  # e.g. 0001-01-01T00:00:00+01:00
        raise InvalidArgumentError(f"billing usage: {field} is out of range (got {value.isoformat()})") from exc
    if value.minute or value.second or value.microsecond:
        raise InvalidArgumentError(f"billing usage: {field} must be on a UTC hour boundary (got {value.isoformat()}); "
                                   "e.g. 2026-07-13T00:00:00Z")
    return value


def window(starting_on: datetime, ending_before: datetime) -> tuple[datetime, datetime]:
    start, end = _utc(starting_on, "starting_on"), _utc(ending_before, "ending_before")
    if start > datetime.now(timezone.utc):
        raise InvalidArgumentError(f"billing usage: starting_on {start.isoformat()} is in the future")
    if not start < end <= start + MAX_WINDOW:
        raise InvalidArgumentError(f"billing usage: ending_before must be after starting_on and at most 14 days "
                                   f"after it (got {start.isoformat()} to {end.isoformat()})")
    return start, end


def _usage_rows(db: Session, who: Principal, start: datetime, end: datetime) -> Iterator[Any]:
    query = (select(F.c.request_type, F.c.request, F.c.request_body, F.c.result, F.c.completed_at,
                    _SESSION.label("session_id"), M.c.base_model, _OWNER.label("owner"))
             .select_from(F.outerjoin(M, M.c.id == F.c.model_id).outerjoin(S, S.c.id == F.c.session_id))
             .where(F.c.status == FutureStatus.COMPLETED.value, F.c.completed_at >= start, F.c.completed_at < end,
                    F.c.request_type.in_((*TRAINING, "sample"))))
    if not who.admin:
        query = query.where(_OWNER == who.key_id)
    yield from db.execute(query.execution_options(yield_per=200))


def _bucket(at: datetime) -> datetime:
    return at.astimezone(timezone.utc).replace(minute=0, second=0, microsecond=0)


def usage_events(db: Session, who: Principal, start: datetime, end: datetime,
                 sampler_base_model: str) -> dict[tuple[Any, ...], int]:
    """(bucket, kind, cached, session, base model, owner) -> tokens (or checkpoints, for kind "checkpoint")."""
    totals: dict[tuple[Any, ...], int] = defaultdict(int)
    for row in _usage_rows(db, who, start, end):
        key = (_bucket(row.completed_at), row.session_id, row.base_model or sampler_base_model, row.owner)
        if row.request_type in TRAINING:
            totals[(key[0], "training", None, *key[1:])] += input_tokens(row.request_body, row.request or {})
            continue
        result = row.result or {}
        prompt = len((row.request or {}).get("prompt_tokens") or [])
        cached = min(int(result.get("prompt_cache_hit_tokens") or 0), prompt)
        totals[(key[0], "sampling_prefill", False, *key[1:])] += prompt - cached
        if cached:
            totals[(key[0], "sampling_prefill", True, *key[1:])] += cached
        totals[(key[0], "sampling_sample", None, *key[1:])] += sum(len(s.get("tokens") or [])
                                                                   for s in result.get("sequences") or [])
    saved = (select(CheckpointRecord.created_at, ModelRecord.session_id, ModelRecord.base_model,
                    ModelRecord.owner_key_id).join(ModelRecord, ModelRecord.id == CheckpointRecord.model_id)
             .where(CheckpointRecord.status.in_(SAVED), CheckpointRecord.created_at >= start,
                    CheckpointRecord.created_at < end))
    if not who.admin:
        saved = saved.where(ModelRecord.owner_key_id == who.key_id)
    for created_at, session_id, base_model, owner in db.execute(saved):
        totals[(_bucket(created_at), "checkpoint", None, session_id, base_model, owner)] += 1
    return totals


def _key_names(db: Session, owners: set[str | None]) -> dict[str | None, str]:
    ids = [o for o in owners if o is not None]
    names: dict[str | None, str] = {None: OWNER}
    if ids:
        names |= dict(db.execute(select(ApiKeyRecord.id, ApiKeyRecord.name).where(ApiKeyRecord.id.in_(ids))).all())
    return names


def _info(kind: str, cached: bool | None, count: int) -> dict[str, Any]:
    if kind == "checkpoint":
        return {"type": kind, "count": count}
    return {"type": kind, "token_count": count, **({"cached": cached} if kind == "sampling_prefill" else {})}


@router.get("/billing/usage/events", responses={**COMMON_ERRORS, **errors(400)})
def billing_usage(starting_on: datetime, ending_before: datetime, request: Request, db: DbDep,
                  who: CallerDep) -> BillingUsageResponse:
    """Hourly usage of the caller's sessions (an admin's: every key's) in [starting_on, ending_before). Tokens are
    counted from finished requests, which the server keeps futures_retention_hours (24 h by default): older hours
    show checkpoints saved only."""
    start, end = window(starting_on, ending_before)
    totals = usage_events(db, who, start, end, request.app.state.settings.base_model)
    sessions = {k[3] for k in totals if k[3] is not None}
    names = _key_names(db, {k[5] for k in totals})
    session_rows = {r.id: r for r in db.scalars(select(SessionRecord).where(SessionRecord.id.in_(sessions)))}
    data = []
    for (bucket, kind, cached, session_id, base_model, owner), count in totals.items():
        session = session_rows.get(session_id)
        data.append({"bucket_start": bucket, "bucket_end": bucket + HOUR, "base_model": base_model,
                     "user_id": owner or OWNER, "user_name": names.get(owner, owner), "session_id": session_id,
                     "project_id": (session.project_id or DEFAULT_PROJECT) if session else None,
                     "event_info": _info(kind, cached, count)})
    data.sort(key=lambda e: (e["bucket_start"], -e["event_info"].get("token_count", e["event_info"].get("count"))))
    metadata = {sid: {"user_metadata": {str(k): str(v) for k, v in (row.user_metadata or {}).items()} or None}
                for sid, row in session_rows.items()}
    return BillingUsageResponse.model_validate({"data": data, "sessions": metadata, "cost_data_through": None})


@router.get("/billing/usage/checkpoints/current", responses={**COMMON_ERRORS, **errors(400)})
def checkpoint_storage(db: DbDep, who: CallerDep,
                       project_id: str | None = None) -> CurrentCheckpointStorageUsageResponse:
    """Checkpoints stored now (ready: listed and not expired or deleted) and their bytes, per project and owner."""
    # Grouped by the raw columns: PostgreSQL cannot match a GROUP BY coalesce(project, $1) to the SELECT's $2.
    query = (select(SessionRecord.project_id, ModelRecord.owner_key_id, func.count(CheckpointRecord.id),
                    func.coalesce(func.sum(CheckpointRecord.size_bytes), 0))
             .join(ModelRecord, ModelRecord.id == CheckpointRecord.model_id)
             .join(SessionRecord, SessionRecord.id == ModelRecord.session_id)
             .where(CheckpointRecord.status == CheckpointStatus.READY.value)
             .group_by(SessionRecord.project_id, ModelRecord.owner_key_id))
    if project_id is not None:
        query = query.where(func.coalesce(SessionRecord.project_id, DEFAULT_PROJECT) == project_id)
    if not who.admin:
        query = query.where(ModelRecord.owner_key_id == who.key_id)
    groups: dict[tuple[str, str | None], list[int]] = defaultdict(lambda: [0, 0])
    for project, owner, count, size in db.execute(query):
        totals = groups[(project or DEFAULT_PROJECT, owner)]  # no project and "default" are one project
        totals[0] += int(count)
        totals[1] += int(size)
    names = _key_names(db, {owner for _, owner in groups})
    data = [{"project_id": project, "org_user_urn": f"skyrl_tx:key:{owner or OWNER}",
             "user_name": names.get(owner, owner), "user_email": None, "checkpoint_count": count, "size_bytes": size,
             "size_gigabytes": size / BYTES_PER_GB, "estimated_monthly_cost_usd": None}
            for (project, owner), (count, size) in sorted(groups.items(), key=lambda g: (g[0][0], g[0][1] or ""))]
    return CurrentCheckpointStorageUsageResponse.model_validate({"data": data})
