"""copy_weights: a readable checkpoint copied to a new training run (one that cannot be trained), listed once whole."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict
from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from skyrl_tx.api.deps import DbDep
from skyrl_tx.api.ownership import owned_session, readable_checkpoint
from skyrl_tx.api.principal import CallerDep, Principal
from skyrl_tx.api.responses import BODY_ERRORS, CopyWeightsResponse, errors
from skyrl_tx.api.routes.checkpoints import check_ttl
from skyrl_tx.api.validation import check_model_seq_id
from skyrl_tx.checkpoints.formats import ModelMeta
from skyrl_tx.checkpoints.paths import TinkerPath
from skyrl_tx.db.models import (CheckpointRecord, CheckpointStatus, ModelRecord, ModelStatus, SessionRecord,
                                SessionStatus)
from skyrl_tx.errors import ConflictError, InternalError, InvalidArgumentError

router = APIRouter(prefix="/api/v1")

WHAT = "copy_weights"
IDEMPOTENCY_HEADER = "X-Idempotency-Key"  # the SDK sends one per copy, the same on every retry of it
COPY_NAMESPACE = uuid.UUID("5b0e6c2a-58f4-4a53-9f0c-3d1e8b6f3c11")  # destination session ids from idempotency keys


class CopyWeightsRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    source_path: str
    destination_project_id: str | None = None
    session_id: str | None = None
    model_seq_id: int | None = None
    ttl_seconds: int | None = None
    weights_access_token: str | None = None  # the SDK sends it as a header; this server reads neither (below)


class CopyInProgress(ConflictError):
    """The first request of this copy is still writing it: 409, which the SDK retries, so a retry of a copy whose
    answer was lost waits for that copy instead of making another."""


def _destination(db: Session, body: CopyWeightsRequest, who: Principal, key: str | None) -> tuple[str, int]:
    """(session id, model_seq_id) of the training run that will hold the copy, the session made here when the
    request names a project. A session made for an idempotency key has an id derived from it (and the caller), so
    every retry of one copy finds the same destination."""
    if body.session_id is not None:
        if body.destination_project_id is not None:
            raise InvalidArgumentError(f"{WHAT}: give destination_project_id, or session_id and model_seq_id, "
                                       "not both")
        if body.model_seq_id is None:
            raise InvalidArgumentError(f"{WHAT}: model_seq_id is required with session_id (the training run slot "
                                       "the copy takes, as in create_model)")
        check_model_seq_id(body.model_seq_id, WHAT)
        owned_session(db, body.session_id, who, f"{WHAT}: session {body.session_id!r} not found")
        return body.session_id, body.model_seq_id
    if body.model_seq_id is not None:
        raise InvalidArgumentError(f"{WHAT}: model_seq_id needs session_id (or give destination_project_id alone)")
    if not body.destination_project_id:
        raise InvalidArgumentError(f"{WHAT}: give destination_project_id (the project that will own the copy), or "
                                   "session_id and model_seq_id")
    session_id = (uuid.uuid5(COPY_NAMESPACE, f"{who.key_id or ''}\0{key}").hex if key else uuid.uuid4().hex)
    if db.get(SessionRecord, session_id) is None:
        # No client heartbeats it: it ends at once; its run and checkpoint stay (like any ended session's).
        db.add(SessionRecord(id=session_id, owner_key_id=who.key_id, project_id=body.destination_project_id,
                             status=SessionStatus.EXPIRED.value, tags=[WHAT], user_metadata={}))
    return session_id, 0


def _claim(db: Session, request: Request, body: CopyWeightsRequest, who: Principal,
           key: str | None) -> tuple[CheckpointRecord, TinkerPath, CheckpointRecord | None]:
    """(source record, the copy's path, its row now "writing" for this request to fill), or a None row where the
    copy is complete already (a retry). The destination row is claimed in one transaction, so of concurrent retries
    one writes and the others wait."""
    source_path = TinkerPath.parse(body.source_path, f"{WHAT}: source_path")
    check_ttl(body.ttl_seconds, WHAT)
    source = readable_checkpoint(db, source_path, who, WHAT)  # its own, or a published one
    session_id, model_seq_id = _destination(db, body, who, key)
    model_id = f"{session_id}:train:{model_seq_id}"
    target = TinkerPath(model_id, source_path.kind, source_path.name)
    model = db.get(ModelRecord, model_id)
    if model is None:
        meta = ModelMeta.from_json(source.model_meta)
        lora = {"rank": meta.lora_rank, "seed": meta.seed, "train_attn": meta.train_attn,
                "train_mlp": meta.train_mlp, "train_unembed": meta.train_unembed, "optimizer": meta.optimizer}
        # Unloaded from the start: it holds the copy, and no training request can reach it.
        db.add(ModelRecord(id=model_id, session_id=session_id, owner_key_id=who.key_id, base_model=meta.base_model,
                           lora_rank=meta.lora_rank, lora_config=lora, status=ModelStatus.UNLOADED.value,
                           user_metadata={"copied_from": str(source_path)}))
    elif (model.user_metadata or {}).get("copied_from") != str(source_path):
        raise InvalidArgumentError(f"{WHAT}: training run {model_id} exists and holds no copy of {source_path}; "
                                   + ("use a free model_seq_id" if body.session_id else
                                      f"use a new {IDEMPOTENCY_HEADER} for a new copy"))
    row = db.scalar(select(CheckpointRecord).where(CheckpointRecord.tinker_path == str(target)))
    if row is not None and row.status == CheckpointStatus.READY.value:
        return source, target, None
    if row is not None and row.status == CheckpointStatus.WRITING.value:
        raise CopyInProgress(f"{WHAT}: {target} is still being copied by an earlier try of this request; retry")
    expires_at = datetime.now(timezone.utc) + timedelta(seconds=body.ttl_seconds) if body.ttl_seconds else None
    if row is None:
        row = CheckpointRecord(model_id=model_id, kind=target.kind, name=target.name, tinker_path=str(target),
                               storage_uri=request.app.state.store.location(target))
        db.add(row)
    # a copy that failed before (the store, or an engine restart mid-copy) is written again
    row.status, row.created_at, row.expires_at = CheckpointStatus.WRITING.value, datetime.now(timezone.utc), expires_at
    row.user_metadata, row.model_meta, row.size_bytes = source.user_metadata, source.model_meta, None
    db.commit()
    return source, target, row


def _finish(db: Session, row_id: int, status: CheckpointStatus, size: int | None) -> bool:
    """The row leaves "writing" only if it is still this copy's: an engine restart fails unfinished rows."""
    done = db.execute(update(CheckpointRecord).where(CheckpointRecord.id == row_id,
                                                     CheckpointRecord.status == CheckpointStatus.WRITING.value)
                      .values(status=status.value, size_bytes=size))
    db.commit()
    return done.rowcount == 1


@router.post("/copy_weights", responses={**BODY_ERRORS, **errors(404, 409)})
def copy_weights(body: CopyWeightsRequest, request: Request, db: DbDep, who: CallerDep) -> CopyWeightsResponse:
    """Copies the files (the store's own copy, then one rename into place), then lists the copy. Readable means
    the caller's own or published (weights_access_token grants nothing here: this server has no such tokens).
    Runs in a worker thread for as long as the copy takes; a retry meanwhile waits (409) for it."""
    key = request.headers.get(IDEMPOTENCY_HEADER)
    try:
        source, target, row = _claim(db, request, body, who, key)
    except IntegrityError:  # a concurrent try of the same copy added its session, run or row first
        db.rollback()
        raise CopyInProgress(f"{WHAT}: {body.source_path} is being copied by a concurrent try of this request; "
                             "retry") from None
    if row is None:  # done by an earlier try
        return CopyWeightsResponse(tinker_path=str(target))
    store, row_id, location = request.app.state.store, row.id, row.storage_uri
    try:
        size = store.publish_copy(source.storage_uri, location)
    except BaseException:
        _finish(db, row_id, CheckpointStatus.FAILED, None)
        raise
    if not _finish(db, row_id, CheckpointStatus.READY, size):
        store.delete(location)
        raise InternalError(f"{WHAT}: the copy to {target} was interrupted by an engine restart; retry")
    return CopyWeightsResponse(tinker_path=str(target))
