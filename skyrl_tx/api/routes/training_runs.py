"""REST for runs and checkpoints (the SDK's RestClient and the `tinker` CLI): list, delete, ttl, downloads."""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from skyrl_tx.api.deps import DbDep
from skyrl_tx.api.ownership import owned_run, readable_checkpoint, writable_checkpoint
from skyrl_tx.api.principal import CallerDep, Principal
from skyrl_tx.api.responses import (BODY_ERRORS, COMMON_ERRORS, CheckpointsListResponse, ExternalWeightsUrlsResponse,
                                     TrainingRun, TrainingRunsResponse, errors)
from skyrl_tx.api.routes.checkpoints import check_ttl
from skyrl_tx.api.url_signing import signature, signature_matches
from skyrl_tx.api.validation import INT64_MAX
from skyrl_tx.checkpoints.paths import TinkerPath
from skyrl_tx.api.request_ids import REQUEST_ID
from skyrl_tx.db import audit
from skyrl_tx.db.models import ApiKeyRecord, CheckpointRecord, CheckpointStatus, ModelRecord, SessionRecord
from skyrl_tx.errors import InvalidArgumentError, NotFoundError

router = APIRouter(prefix="/api/v1")
PAGE_ERRORS = errors(400, 401, 500)  # limit / offset out of range
PATH_ERRORS = {**COMMON_ERRORS, **errors(404)}  # a run or checkpoint the caller cannot see is not found

URL_LIFETIME_S = 3600  # signed download URLs stay valid this long
OWNER = "local"  # the owner of what was made with --auth none (with keys: the key's id)
DEFAULT_PROJECT = "default"  # the project of a session created without one (this server keeps no project list)


class TtlRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    ttl_seconds: int | None = None


def checkpoint_json(row: CheckpointRecord) -> dict[str, Any]:
    path = TinkerPath(row.model_id, row.kind, row.name)
    return {"checkpoint_id": path.checkpoint_id, "checkpoint_type": path.checkpoint_type,
            "time": row.created_at.isoformat(), "tinker_path": row.tinker_path, "size_bytes": row.size_bytes,
            "public": bool(row.public), "user_metadata": row.user_metadata, "expires_at":
            row.expires_at.isoformat() if row.expires_at else None}


def _listed():
    return select(CheckpointRecord).where(CheckpointRecord.status == CheckpointStatus.READY.value)


def _runs_of(who: Principal, project_id: str | None = None):
    """The models (training runs) `who` sees: every one for an admin (and --auth none), else its own; with
    `project_id`, those whose session is in that project (sessions made without one are in "default")."""
    query = select(ModelRecord)
    if project_id is not None:
        in_project = select(SessionRecord.id).where(func.coalesce(SessionRecord.project_id, DEFAULT_PROJECT)
                                                    == project_id)
        query = query.where(ModelRecord.session_id.in_(in_project))
    return query if who.admin else query.where(ModelRecord.owner_key_id == who.key_id)


def _run_json(db: Session, model: ModelRecord) -> dict[str, Any]:
    latest = {}
    for kind in ("weights", "sampler_weights"):
        row = db.scalar(_listed().where(CheckpointRecord.model_id == model.id, CheckpointRecord.kind == kind)
                        .order_by(CheckpointRecord.created_at.desc()).limit(1))
        latest[kind] = checkpoint_json(row) if row else None
    metadata = {str(k): str(v) for k, v in (model.user_metadata or {}).items()} or None
    return {"training_run_id": model.id, "base_model": model.base_model, "model_owner": model.owner_key_id or OWNER,
            "is_lora": model.lora_rank > 0, "lora_rank": model.lora_rank or None, "corrupted": False,
            "last_request_time": (model.last_request_at or model.created_at).isoformat(),
            "last_checkpoint": latest["weights"], "last_sampler_checkpoint": latest["sampler_weights"],
            "user_metadata": metadata}


def page_bounds(limit: int, offset: int) -> tuple[int, int]:
    if limit < 1 or limit > 1000 or not 0 <= offset <= INT64_MAX:  # the database takes a signed 64-bit offset
        raise InvalidArgumentError(f"limit must be in [1, 1000] and offset in [0, {INT64_MAX}] (got limit={limit}, "
                                   f"offset={offset})")
    return limit, offset


@router.get("/training_runs", responses=PAGE_ERRORS)
def list_training_runs(db: DbDep, who: CallerDep, limit: int = 20, offset: int = 0,
                        project_id: str | None = None) -> TrainingRunsResponse:
    """The caller's runs, newest first; `project_id` keeps those of sessions in that project (assign_session_project
    moves a session, and its runs, into one)."""
    limit, offset = page_bounds(limit, offset)
    runs = _runs_of(who, project_id)
    total = db.scalar(select(func.count()).select_from(runs.subquery()))
    models = db.scalars(runs.order_by(ModelRecord.created_at.desc()).limit(limit).offset(offset))
    return TrainingRunsResponse.model_validate(
        {"training_runs": [_run_json(db, m) for m in models],
         "cursor": {"offset": offset, "limit": limit, "total_count": total}})


@router.get("/training_runs/{run_id}", responses=PATH_ERRORS)
def get_training_run(run_id: str, db: DbDep, who: CallerDep) -> TrainingRun:
    return TrainingRun.model_validate(_run_json(db, owned_run(db, run_id, who)))


@router.get("/training_runs/{run_id}/checkpoints", responses=PATH_ERRORS)
def list_run_checkpoints(run_id: str, db: DbDep, who: CallerDep) -> CheckpointsListResponse:
    owned_run(db, run_id, who)
    rows = db.scalars(_listed().where(CheckpointRecord.model_id == run_id).order_by(CheckpointRecord.created_at))
    return CheckpointsListResponse.model_validate({"checkpoints": [checkpoint_json(r) for r in rows], "cursor": None})


@router.get("/checkpoints", responses=PAGE_ERRORS)
def list_all_checkpoints(db: DbDep, who: CallerDep, limit: int = 100, offset: int = 0) -> CheckpointsListResponse:
    limit, offset = page_bounds(limit, offset)
    listed = _listed()
    if not who.admin:  # the caller's own checkpoints (published ones of others are read by path, not listed)
        listed = listed.join(ModelRecord, ModelRecord.id == CheckpointRecord.model_id).where(
            ModelRecord.owner_key_id == who.key_id)
    total = db.scalar(select(func.count()).select_from(listed.subquery()))
    rows = db.scalars(listed.order_by(CheckpointRecord.created_at.desc()).limit(limit).offset(offset))
    return CheckpointsListResponse.model_validate(
        {"checkpoints": [checkpoint_json(r) for r in rows],
         "cursor": {"offset": offset, "limit": limit, "total_count": total}})


def _path(run_id: str, kind: str, name: str) -> TinkerPath:
    return TinkerPath.from_checkpoint_id(run_id, f"{kind}/{name}")


def _writable(db: Session, run_id: str, kind: str, name: str, who: Principal) -> CheckpointRecord:
    return writable_checkpoint(db, _path(run_id, kind, name), who, "checkpoint")


def _audit(db: Session, event: str, row: CheckpointRecord, who: Principal, **details: object) -> None:
    """The change's audit entry, committed with it (db/audit.py)."""
    owner = db.scalar(select(ModelRecord.owner_key_id).where(ModelRecord.id == row.model_id))
    audit.record(db, event, actor=who.key_id, owner=owner, resource=row.tinker_path, request_id=REQUEST_ID.get(),
                 details={"model_id": row.model_id, "tinker_path": row.tinker_path, **details})


@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id}", responses=errors(400, 401, 500))
def delete_bare_checkpoint_id(run_id: str, checkpoint_id: str) -> None:
    TinkerPath.from_checkpoint_id(run_id, checkpoint_id)  # always raises: the kind is missing


@router.delete("/training_runs/{run_id}/checkpoints/{kind}/{name}", responses={**PATH_ERRORS, **errors(400)})
def delete_checkpoint(run_id: str, kind: str, name: str, request: Request, db: DbDep, who: CallerDep) -> None:
    row = _writable(db, run_id, kind, name, who)
    row.status = CheckpointStatus.DELETED.value  # unlisted first: a reader never sees a half-deleted checkpoint
    _audit(db, "checkpoint_delete", row, who, size_bytes=row.size_bytes)
    db.commit()
    request.app.state.store.delete(row.storage_uri)


@router.put("/training_runs/{run_id}/checkpoints/{kind}/{name}/ttl", responses={**BODY_ERRORS, **errors(404)})
def set_checkpoint_ttl(run_id: str, kind: str, name: str, body: TtlRequest, db: DbDep, who: CallerDep) -> None:
    check_ttl(body.ttl_seconds, "set ttl")
    row = _writable(db, run_id, kind, name, who)
    row.expires_at = (datetime.now(timezone.utc) + timedelta(seconds=body.ttl_seconds)
                      if body.ttl_seconds is not None else None)
    _audit(db, "checkpoint_ttl_set", row, who, ttl_seconds=body.ttl_seconds)
    db.commit()


@router.post("/training_runs/{run_id}/checkpoints/{kind}/{name}/publish", responses={**PATH_ERRORS, **errors(400)})
def publish_checkpoint(run_id: str, kind: str, name: str, db: DbDep, who: CallerDep) -> None:
    """Every key may then read it by its tinker:// path (load, sample, download); only its owner may change it."""
    row = _writable(db, run_id, kind, name, who)
    row.public = True
    _audit(db, "checkpoint_publish", row, who)
    db.commit()


@router.delete("/training_runs/{run_id}/checkpoints/{kind}/{name}/publish", responses={**PATH_ERRORS, **errors(400)})
def unpublish_checkpoint(run_id: str, kind: str, name: str, db: DbDep, who: CallerDep) -> None:
    row = _writable(db, run_id, kind, name, who)
    row.public = False
    _audit(db, "checkpoint_unpublish", row, who)
    db.commit()


@router.get("/training_runs/{run_id}/checkpoints/{kind}/{name}/external_weights_urls",
            responses={**PATH_ERRORS, **errors(400)})
def external_weights_urls(run_id: str, kind: str, name: str, request: Request, db: DbDep,
                          who: CallerDep) -> ExternalWeightsUrlsResponse:
    row = readable_checkpoint(db, _path(run_id, kind, name), who, "checkpoint")  # its own, or a published one
    expires = int(time.time()) + URL_LIFETIME_S
    secret = request.app.state.download_secret  # api/url_signing.py: survives restarts
    base = request.app.state.settings.public_base_url()  # never the request's Host header: a client could set it
    key_id = who.key_id or ""  # the download checks this key is still valid and still reads the checkpoint
    urls = {file: f"{base}/api/v1/checkpoint_files/{row.id}/{file}?expires={expires}&key={key_id}&"
                  f"sig={signature(secret, row.id, file, expires, key_id)}"
            for file in request.app.state.store.files(row.storage_uri)}
    return ExternalWeightsUrlsResponse(urls=urls, expires=datetime.fromtimestamp(expires, timezone.utc))


# Open without an API key (the signature is the credential): no 401.
@router.get("/checkpoint_files/{checkpoint}/{file:path}", response_class=StreamingResponse, responses={
    200: {"description": "the file's bytes", "content": {"application/octet-stream": {
        "schema": {"type": "string", "format": "binary"}}}}, **errors(400, 404, 500)})
def download_checkpoint_file(checkpoint: int, file: str, expires: int, sig: str, request: Request,
                             db: DbDep, key: str = "") -> StreamingResponse:
    """A signed URL from external_weights_urls; streamed in chunks, never read whole into memory. The URL carries no
    credential but its signature, so the key it was issued to is checked here: revoked, or no longer able to read the
    checkpoint (unpublished by its owner), and the URL stops working before it expires."""
    if not signature_matches(request.app.state.download_secret, checkpoint, file, expires, key, sig) \
            or expires < time.time():
        raise InvalidArgumentError("download: the URL's signature is invalid or expired; request new URLs")
    row = db.get(CheckpointRecord, checkpoint)
    if row is None or row.status != CheckpointStatus.READY.value:
        raise NotFoundError("download: the checkpoint was deleted")
    if key:
        issued_to = db.get(ApiKeyRecord, key)
        if issued_to is None or issued_to.revoked_at is not None:
            raise NotFoundError("download: the API key these URLs were issued to was revoked; request new URLs with "
                                "a valid key")
        who = Principal(issued_to.id, issued_to.name, issued_to.admin)
        readable_checkpoint(db, TinkerPath.parse(row.tinker_path, "download"), who, "download")
    store = request.app.state.store
    size = store.files(row.storage_uri).get(file)
    if size is None:
        raise NotFoundError(f"download: {file!r} is not a file of {row.tinker_path}")
    return StreamingResponse(store.open_stream(row.storage_uri, file), media_type="application/octet-stream",
                             headers={"Content-Length": str(size)})
