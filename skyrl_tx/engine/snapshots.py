"""Sampler snapshot retention: each model keeps only its newest frozen weight versions in memory.

An RL loop takes a sampler snapshot every step; kept forever they would fill host memory. A model keeps its
KEEP_PER_MODEL newest ephemeral snapshots (sampling clients from save_weights_and_get_sampling_client) and
its KEEP_PER_MODEL newest named ones (those reload from disk on demand, so dropping them costs only a reload).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from skyrl_tx.db.models import CheckpointRecord, CheckpointStatus, SamplingSessionRecord
from skyrl_tx.errors import ConflictError, NotFoundError

KEEP_PER_MODEL = 8  # enough for off-policy RL that samples with weights a few steps old


def ephemeral_newest_first(db: Session, model_id: str) -> list[str]:
    rows = db.scalars(select(SamplingSessionRecord.snapshot_id).where(
        SamplingSessionRecord.model_id == model_id, SamplingSessionRecord.snapshot_id.is_not(None),
        SamplingSessionRecord.model_path.is_(None)).order_by(SamplingSessionRecord.created_at.desc()))
    return [r for r in rows if r]


def release_old_snapshots(backend: Any, db: Session, model_id: str, checkpointer: Any = None) -> None:
    """Frees snapshots past the newest KEEP_PER_MODEL; one still serving samples is freed on a later call.
    With the engine's Checkpointer, full fine-tuning snapshots evicted to disk are forgotten too."""
    named = list(db.scalars(select(CheckpointRecord.tinker_path).where(
        CheckpointRecord.model_id == model_id, CheckpointRecord.kind == "sampler_weights",
        CheckpointRecord.status == CheckpointStatus.READY.value).order_by(CheckpointRecord.created_at.desc())))
    for snapshot_id in ephemeral_newest_first(db, model_id)[KEEP_PER_MODEL:] + named[KEEP_PER_MODEL:]:
        try:
            if checkpointer is not None:
                checkpointer.remove_snapshot(snapshot_id)
            elif backend.has_snapshot(snapshot_id):
                backend.remove_snapshot(snapshot_id)
        except ConflictError:
            pass


def released_error(sampler_id: str) -> NotFoundError:
    return NotFoundError(f"sampling session {sampler_id!r}: its weights were released (the server keeps the "
                         f"{KEEP_PER_MODEL} newest sampler snapshots of each model); create a new sampling client "
                         "(save_weights_and_get_sampling_client), or save named sampler weights to keep a version")
