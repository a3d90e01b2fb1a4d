"""Who owns what, checked in one place: owned_* lookups that answer 404 (never 403) for another key's objects, and
the per-key quotas (429 for a rate that waiting frees, 403 for a count that only the client can free).

Owners are recorded on sessions and models only (`owner_key_id`, set by the API); everything else belongs to
its session or model: a sampling session to its session, a future to its model (or, for sample and create_model
futures, its session), a checkpoint to its model. So the engine, which creates checkpoint and sampling-session rows,
knows nothing of keys, and an owner can never disagree between two rows. The hot routes read the owner in the same
statement that reads what they need anyway (a model's status, a sampler's weights, a future's outcome)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, bindparam, case, func, select
from sqlalchemy.orm import Session

from skyrl_tx.api.principal import Principal
from skyrl_tx.checkpoints.catalog import ready_checkpoint
from skyrl_tx.checkpoints.paths import TinkerPath
from skyrl_tx.db.models import (CheckpointRecord, FutureRecord, FutureStatus, ModelRecord, ModelStatus,
                                SamplingSessionRecord, SessionRecord)
from skyrl_tx.errors import ErrorCode, NotFoundError, SkyrlTxError

FUTURES, MODELS = FutureRecord.__table__, ModelRecord.__table__
SESSIONS, SAMPLERS = SessionRecord.__table__, SamplingSessionRecord.__table__
LIVE = (ModelStatus.PENDING.value, ModelStatus.READY.value)
INFLIGHT = (FutureStatus.PENDING.value, FutureStatus.RUNNING.value)
INFLIGHT_RETRY_AFTER_S = 1  # requests finish in seconds: ask again soon


class QuotaExceededError(SkyrlTxError):
    """A key's rate quota is used up for now: 429 with Retry-After (api/auth.py; the SDK waits, then retries)."""

    code, http_status, category = ErrorCode.RESOURCE_EXHAUSTED, 429, "user"

    def __init__(self, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QuotaFullError(QuotaExceededError):
    """A quota that waiting does not free (max_live_models: a slot frees only when its owner unloads a model or ends
    a session): 403, which the SDK raises at once (PermissionDeniedError). A 429 it retries for up to two hours, so
    create_lora_training_client seemed to hang."""

    http_status = 403


# A future's owner: its model's, else its session's (sample and create_model futures carry a session, no model).
_FUTURE_JOIN = FUTURES.outerjoin(MODELS, MODELS.c.id == FUTURES.c.model_id).outerjoin(
    SESSIONS, SESSIONS.c.id == FUTURES.c.session_id)
_FUTURE_OWNER = func.coalesce(MODELS.c.owner_key_id, SESSIONS.c.owner_key_id)

MODEL_ACCESS = select(MODELS.c.status, MODELS.c.owner_key_id).where(MODELS.c.id == bindparam("id_"))
# What asample needs of its sampling session (the weights, the session) and the session's owner, in one statement.
# An inflight sampling session samples its model's newest inflight snapshot, read here, at submission: never older
# than the one it was created with (the SDK's inflight contract).
SAMPLER_ACCESS = select(
    case((SAMPLERS.c.inflight, func.coalesce(MODELS.c.inflight_snapshot_id, SAMPLERS.c.snapshot_id)),
         else_=SAMPLERS.c.snapshot_id).label("snapshot_id"),
    SAMPLERS.c.session_id, SESSIONS.c.owner_key_id).select_from(
    SAMPLERS.join(SESSIONS, SESSIONS.c.id == SAMPLERS.c.session_id).outerjoin(
        MODELS, MODELS.c.id == SAMPLERS.c.model_id)).where(SAMPLERS.c.id == bindparam("id_"))
# retrieve_future's first read (db/future_queries.py OUTCOME's columns) with the owner.
OWNED_OUTCOME = select(FUTURES.c.status, FUTURES.c.request_type, FUTURES.c.result, FUTURES.c.result_body,
                       FUTURES.c.error, _FUTURE_OWNER.label("owner_key_id")).select_from(_FUTURE_JOIN).where(
    FUTURES.c.id == bindparam("id_"))
# cancel_future's read: what the future is, and its owner.
OWNED_REQUEST = select(FUTURES.c.request_type, FUTURES.c.model_id, FUTURES.c.seq_id,
                       _FUTURE_OWNER.label("owner_key_id")).select_from(_FUTURE_JOIN).where(
    FUTURES.c.id == bindparam("id_"))
COUNT_INFLIGHT = select(func.count()).select_from(_FUTURE_JOIN).where(
    FUTURES.c.status.in_(INFLIGHT), _FUTURE_OWNER == bindparam("owner"))
COUNT_LIVE_MODELS = select(func.count()).select_from(MODELS).where(
    MODELS.c.owner_key_id == bindparam("owner"), MODELS.c.status.in_(LIVE))


def model_not_found(model_id: str) -> NotFoundError:
    return NotFoundError(f"model {model_id!r} not found; create it with create_model (or a training client) first")


def require_owned_model(db: Session | Connection, model_id: str, who: Principal | None) -> None:
    """NotFoundError unless the model exists, is not unloaded and `who` sees it (one statement: the hot-path check)."""
    row = db.execute(MODEL_ACCESS, {"id_": model_id}).one_or_none()
    if row is None or row.status == ModelStatus.UNLOADED.value or who is None or not who.sees(row.owner_key_id):
        raise model_not_found(model_id)


def owned_live_model(db: Session, model_id: str, who: Principal) -> ModelRecord:
    """The model's record, with require_owned_model's NotFoundError."""
    model = db.get(ModelRecord, model_id)
    if model is None or model.status == ModelStatus.UNLOADED.value or not who.sees(model.owner_key_id):
        raise model_not_found(model_id)
    return model


def owned_run(db: Session, run_id: str, who: Principal) -> ModelRecord:
    """A training run (a model, in any state) of `who`."""
    model = db.get(ModelRecord, run_id)
    if model is None or not who.sees(model.owner_key_id):
        raise NotFoundError(f"training run {run_id!r} not found")
    return model


def owned_session(db: Session, session_id: str, who: Principal, message: str) -> SessionRecord:
    session = db.get(SessionRecord, session_id)
    if session is None or not who.sees(session.owner_key_id):
        raise NotFoundError(message)
    return session


def owned_sampler(db: Session | Connection, sampler_id: str, who: Principal, message: str) -> Any:
    """SAMPLER_ACCESS's row (snapshot_id, session_id, owner_key_id) of a sampling session `who` sees."""
    row = db.execute(SAMPLER_ACCESS, {"id_": sampler_id}).one_or_none()
    if row is None or not who.sees(row.owner_key_id):
        raise NotFoundError(message)
    return row


def _checkpoint_owner(db: Session, record: CheckpointRecord) -> str | None:
    return db.scalar(select(MODELS.c.owner_key_id).where(MODELS.c.id == record.model_id))


def readable_checkpoint(db: Session, path: TinkerPath, who: Principal, what: str) -> CheckpointRecord:
    """A ready checkpoint `who` may read: its own, or a published one (load, sample, download). Another key's
    unpublished checkpoint gets ready_checkpoint's "not found", word for word."""
    record = ready_checkpoint(db, path, what)
    if not record.public and not who.sees(_checkpoint_owner(db, record)):
        raise _checkpoint_not_found(path, what)
    return record


def writable_checkpoint(db: Session, path: TinkerPath, who: Principal, what: str) -> CheckpointRecord:
    """A ready checkpoint `who` may change (delete, TTL, publish): its own only, published or not."""
    record = ready_checkpoint(db, path, what)
    if not who.sees(_checkpoint_owner(db, record)):
        raise _checkpoint_not_found(path, what)
    return record


def _checkpoint_not_found(path: TinkerPath, what: str) -> NotFoundError:
    # The words of checkpoints/catalog.py's ready_checkpoint: another key cannot tell "not yours" from "not there".
    return NotFoundError(f"{what}: checkpoint {path} not found (never saved, deleted, expired, or its save failed)")


def check_live_models(db: Session, who: Principal) -> None:
    """403 when `who` has max_live_models models live (pending or ready) already: not retried, since only the key's
    own client frees a slot."""
    if who.max_live_models is None:
        return
    live = db.execute(COUNT_LIVE_MODELS, {"owner": who.key_id}).scalar_one()
    if live >= who.max_live_models:
        raise QuotaFullError(
            f"quota exceeded: API key {who.name!r} has {live} live model(s), its max_live_models quota is "
            f"{who.max_live_models}; waiting will not free a slot: unload one of its models (POST "
            "/api/v1/unload_model) or end the session that holds it (ServiceClient.close(), or let it time out), or "
            "ask the operator for a larger max_live_models")


def check_inflight(db: Session | Connection, who: Principal) -> None:
    """429 when `who` has max_inflight_requests requests queued or running already (only keys with that quota pay
    for the count: one indexed statement, in the connection the route holds anyway)."""
    if who.max_inflight_requests is None:
        return
    inflight = db.execute(COUNT_INFLIGHT, {"owner": who.key_id}).scalar_one()
    if inflight >= who.max_inflight_requests:
        raise QuotaExceededError(
            f"quota exceeded: API key {who.name!r} has {inflight} request(s) queued or running, its "
            f"max_inflight_requests quota is {who.max_inflight_requests}; wait for results before sending more, or "
            "ask the operator for a larger quota", INFLIGHT_RETRY_AFTER_S)
