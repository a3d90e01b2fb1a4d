"""sweep_retention: deletes finished futures past the retention window, and recovery snapshots no longer usable.

Kept, whatever their age: anything not finished; a recorded sample (record_stability_info) a datum named within
the last day (db StabilityUseRecord; api/provenance.py); the create request of a live (pending or ready) model; every
request of a live model from its recovery base on (engine/recovery_state.recovery_base: the snapshot a restart
starts from, or, with none, the whole history), which also keeps its newest seq_id for ordering and its recent
ones for idempotent retries. Old requests of live models before their base, of unloaded or failed models, and
of no model (sampling) go. Each sweep deletes at most `batch` futures, so it never holds the engine long;
`maybe_sweep` (called from the engine's periodic sweep) runs one every SWEEP_EVERY_S, or at once while a backlog
remains. A client retrying a request older than the window would have it stored anew: the window must exceed
any client's retry horizon.

Setting (--backend-config, host-only): futures_retention_hours (default 24).
"""

from __future__ import annotations

import logging
import time
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy import delete, or_, select

from skyrl_tx.db.models import (STABILITY_RECORD_TTL, FutureRecord, FutureStatus, ModelRecord, ModelStatus,
                               RecoverySnapshotRecord, StabilityUseRecord)
from skyrl_tx.engine import recovery_state

log = logging.getLogger("skyrl_tx.engine")

RETENTION_HOURS = 24.0  # default of the backend-config key futures_retention_hours
BATCH = 500  # futures deleted per sweep at most
SWEEP_EVERY_S = 60.0
LIVE = (ModelStatus.PENDING.value, ModelStatus.READY.value)
FINISHED = (FutureStatus.COMPLETED.value, FutureStatus.FAILED.value)


def maybe_sweep(loop: Any) -> int:
    """A retention sweep if one is due; returns the futures deleted."""
    now = time.monotonic()
    if now < getattr(loop, "_retention_next_sweep", 0.0):
        return 0
    hours = getattr(getattr(loop.backend, "settings", None), "futures_retention_hours", RETENTION_HOURS)
    deleted = sweep_retention(loop, retention_hours=hours)
    loop._retention_next_sweep = now + (0.0 if deleted >= BATCH else SWEEP_EVERY_S)  # a backlog: go on next time
    return deleted


def sweep_retention(loop: Any, retention_hours: float = RETENTION_HOURS, batch: int = BATCH) -> int:
    """Deletes up to `batch` expired futures and the unusable recovery snapshots; returns the futures deleted."""
    now = datetime.now(timezone.utc)
    cutoff = now - timedelta(hours=retention_hours)
    store = loop.checkpointer.store
    ids: list[str] = []
    with loop.sessions.begin() as db:
        old = (FutureRecord.status.in_(FINISHED), FutureRecord.completed_at < cutoff)
        live = select(ModelRecord.id).where(ModelRecord.status.in_(LIVE))
        # Of no model (samples; create requests, which carry their model only in the id) or of a dead model.
        ids += db.scalars(select(FutureRecord.id).where(
            *old, or_(FutureRecord.model_id.is_(None), FutureRecord.model_id.not_in(live)),
            FutureRecord.id.not_in(select(ModelRecord.id + ":create").where(ModelRecord.status.in_(LIVE))),
            FutureRecord.id.not_in(select(StabilityUseRecord.request_id).where(  # recorded samples still in use
                StabilityUseRecord.last_used_at >= now - STABILITY_RECORD_TTL)))
            .limit(batch)).all()
        # Of a live model, before its recovery base.
        for model_id in db.scalars(live.where(ModelRecord.id.in_(select(RecoverySnapshotRecord.model_id)))).all():
            if len(ids) >= batch:
                break
            base = recovery_state.recovery_base(db, model_id)
            if base is None:
                continue
            ids += db.scalars(select(FutureRecord.id).where(
                *old, FutureRecord.model_id == model_id, FutureRecord.seq_id < base.seq_id,
                FutureRecord.id != f"{model_id}:create").limit(batch - len(ids))).all()
        if ids:
            db.execute(delete(FutureRecord).where(FutureRecord.id.in_(ids)))
        expired_uses = list(db.scalars(select(StabilityUseRecord.request_id).where(
            StabilityUseRecord.last_used_at < now - STABILITY_RECORD_TTL).limit(batch)))
        if expired_uses:  # their records expired: the futures go with the ordinary retention above
            db.execute(delete(StabilityUseRecord).where(StabilityUseRecord.request_id.in_(expired_uses)))
        # Snapshots of models that will never be rebuilt.
        dead = list(db.scalars(select(RecoverySnapshotRecord).where(
            RecoverySnapshotRecord.model_id.not_in(live)).limit(batch)))
        for snap in dead:
            store.delete(snap.location)
            db.delete(snap)
    if ids or dead:
        log.info("retention: deleted %d futures older than %.1f h and %d recovery snapshots of unloaded models",
                 len(ids), retention_hours, len(dead))
    return len(ids)
