"""ready_checkpoint: the listed (completely written) checkpoint at a tinker:// path — shared by API and engine."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from skyrl_tx.checkpoints.paths import TinkerPath
from skyrl_tx.db.models import CheckpointRecord, CheckpointStatus
from skyrl_tx.errors import NotFoundError


def ready_checkpoint(db: Session, path: TinkerPath, what: str) -> CheckpointRecord:
    record = db.scalar(select(CheckpointRecord).where(CheckpointRecord.tinker_path == str(path),
                                                      CheckpointRecord.status == CheckpointStatus.READY.value))
    if record is None:
        raise NotFoundError(f"{what}: checkpoint {path} not found (never saved, deleted, expired, or its save failed)")
    return record
