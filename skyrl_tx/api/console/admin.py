"""The console's admin pages (/console/admin/...): keys, usage and the audit log, for an admin key (and the local
owner of --auth none); any other key gets a 403 page. Read with the functions the admin REST routes use."""

from __future__ import annotations

from collections import defaultdict
from datetime import date, datetime, timedelta, timezone
from typing import Any

from fastapi import APIRouter, Request, Response

from skyrl_tx.api.console.pages import page
from skyrl_tx.api.console.render import ConsoleRoute
from skyrl_tx.api.deps import DbDep
from skyrl_tx.api.principal import CallerDep, Principal
from skyrl_tx.api.routes.audit_log import audit_log
from skyrl_tx.api.routes.usage import billing_usage, checkpoint_storage
from skyrl_tx.errors import ErrorCode, SkyrlTxError
from skyrl_tx.keys import key_infos

router = APIRouter(prefix="/console/admin", route_class=ConsoleRoute, include_in_schema=False)
USAGE_HOURS = 24  # the usage page's window: the last day, by the hour
AUDIT_LIMIT = 1000  # entries of a day shown (the oldest first)


class NotAdminError(SkyrlTxError):
    """A console admin page asked for with a key that is not an admin: 403 (the key exists, and is not allowed)."""

    code, http_status, category = ErrorCode.INVALID_ARGUMENT, 403, "user"


def _admin(who: Principal, what: str) -> None:
    if not who.admin:
        raise NotAdminError(f"{what}: API key {who.name!r} is not an admin key; only an admin key sees every key's "
                            "keys, usage and audit log (an operator makes one with `skyrl-tx keys create --name NAME "
                            "--admin`)")


@router.get("/keys")
def keys_page(request: Request, db: DbDep, who: CallerDep) -> Response:
    """Every key (never a key itself: its prefix), and what each did since this server started (/metrics' per-key
    counters: requests by type and outcome, tokens)."""
    _admin(who, "keys")
    requests: dict[str, dict[str, int]] = defaultdict(dict)
    for family in request.app.state.key_metrics.collect():
        for sample in family.samples:
            labels = sample.labels
            column = f"{labels['type']} {labels['outcome']}" if "type" in labels else f"tokens {labels['kind']}"
            requests[labels["key_id"]][column] = int(sample.value)
    columns = sorted({c for per_key in requests.values() for c in per_key})
    return page(request, "keys.html", who, keys=key_infos(db), requests=requests, columns=columns)


@router.get("/usage")
def usage_page(request: Request, db: DbDep, who: CallerDep) -> Response:
    """The last USAGE_HOURS hours' usage per key and kind, hour by hour, and the checkpoint bytes stored now."""
    _admin(who, "usage")
    end = datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)
    usage = billing_usage(end - timedelta(hours=USAGE_HOURS), end, request, db, who)
    totals: dict[tuple[str, str], int] = defaultdict(int)
    for event in usage.data:
        info: Any = event.event_info
        totals[(event.user_name or event.user_id or "", info.type)] += getattr(info, "token_count", None) or \
            getattr(info, "count", 0)
    return page(request, "usage.html", who, events=usage.data, totals=sorted(totals.items()),
                storage=checkpoint_storage(db, who).data, hours=USAGE_HOURS)


@router.get("/audit")
def audit_page(request: Request, db: DbDep, who: CallerDep, day: date | None = None) -> Response:
    _admin(who, "audit log")
    day = day or datetime.now(timezone.utc).date()
    found = audit_log(db, who, event_type="all", day=day, limit=AUDIT_LIMIT, after_id=0)
    return page(request, "audit.html", who, entries=found.entries, day=day, more=found.next_after_id is not None,
                previous=day - timedelta(days=1), following=day + timedelta(days=1))
