"""Checkpoint requests of a training client: save_weights, save_weights_external, load_weights, weights_info."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict
from sqlalchemy.orm import Session

from skyrl_tx.api.deps import DbDep, SettingsDep
from skyrl_tx.api.optimizers import OPTIMIZER_CONFIGS, optimizer_kind, stored_optimizer
from skyrl_tx.api.ownership import (check_inflight, check_live_models, owned_session, readable_checkpoint,
                                    require_owned_model)
from skyrl_tx.api.principal import CallerDep, Principal
from skyrl_tx.api.responses import BODY_ERRORS, ModelFuture, WeightsInfoResponse, errors
from skyrl_tx.api.submit import consumes_seq_id, submit_future
from skyrl_tx.api.validation import check_json_finite, check_model_seq_id, check_seq_id
from skyrl_tx.checkpoints.formats import ModelMeta
from skyrl_tx.checkpoints.paths import TinkerPath, validate_name
from skyrl_tx.db.models import CheckpointRecord, ModelRecord
from skyrl_tx.errors import InvalidArgumentError

router = APIRouter(prefix="/api/v1", responses=BODY_ERRORS)
SUBMIT_ERRORS = errors(404, 409, 429)

MIN_TTL_S, MAX_TTL_S = 3600, 10 * 365 * 24 * 3600  # the SDK's documented range


class SaveWeightsRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model_id: str
    path: str | None = None
    seq_id: int
    ttl_seconds: int | None = None
    overwrite: bool = False
    user_metadata: dict[str, str] | None = None


class LoadWeightsRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    path: str
    optimizer: bool = False
    model_id: str | None = None  # legacy: load into an existing, untrained model (with seq_id)
    seq_id: int | None = None
    session_id: str | None = None  # create-via-load: a new model <session_id>:train:<model_seq_id>
    model_seq_id: int | None = None
    base_model: str | None = None
    user_metadata: dict[str, Any] | None = None
    optimizer_config: dict[str, Any] | None = None


class WeightsInfoRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    tinker_path: str


def check_ttl(ttl_seconds: int | None, what: str) -> None:
    if ttl_seconds is not None and not MIN_TTL_S <= ttl_seconds <= MAX_TTL_S:
        raise InvalidArgumentError(f"{what}: ttl_seconds must be between {MIN_TTL_S} (1 hour) and {MAX_TTL_S} "
                                   f"(10 years), or null for no expiry (got {ttl_seconds})")


def submit_save(request: Request, db: Session, body: SaveWeightsRequest, kind: str, request_type: str,
                who: Principal) -> ModelFuture:
    check_seq_id(body.seq_id, request_type)
    require_owned_model(db, body.model_id, who)
    check_inflight(db, who)
    with consumes_seq_id(request, db, model_id=body.model_id, seq_id=body.seq_id, request_type=request_type):
        name = validate_name(body.path, request_type)
        check_ttl(body.ttl_seconds, request_type)
    job = {"model_id": body.model_id, "path": str(TinkerPath(body.model_id, kind, name)),
           "overwrite": body.overwrite, "ttl_seconds": body.ttl_seconds, "user_metadata": body.user_metadata}
    future_id = submit_future(request, db, future_id=f"{body.model_id}:{body.seq_id}", request_type=request_type,
                              body=job, model_id=body.model_id, seq_id=body.seq_id)
    return ModelFuture(request_id=future_id, model_id=body.model_id)


@router.post("/save_weights", responses=SUBMIT_ERRORS)
def save_weights(body: SaveWeightsRequest, request: Request, db: DbDep, who: CallerDep) -> ModelFuture:
    return submit_save(request, db, body, "weights", "save_weights", who)


@router.post("/save_weights_external", responses=SUBMIT_ERRORS)
def save_weights_external(body: SaveWeightsRequest, request: Request, db: DbDep, who: CallerDep) -> ModelFuture:
    return submit_save(request, db, body, "external_weights", "save_weights_external", who)


def checkpoint_meta(db: Session, path: TinkerPath, who: Principal, what: str) -> tuple[CheckpointRecord, ModelMeta]:
    """A checkpoint `who` may read (its own or a published one) and what loading it needs."""
    record = readable_checkpoint(db, path, who, what)
    return record, ModelMeta.from_json(record.model_meta)


def _training_checkpoint(db: Session, raw_path: str, who: Principal) -> tuple[TinkerPath, ModelMeta]:
    path = TinkerPath.parse(raw_path, "load_weights: path")
    if path.kind != "weights":
        raise InvalidArgumentError(f"load_weights: {path} is a {path.checkpoint_type} checkpoint; load a training "
                                   "checkpoint (tinker://<run>/weights/<name>, written by save_state)")
    return path, checkpoint_meta(db, path, who, "load_weights")[1]


@router.post("/load_weights", responses={**SUBMIT_ERRORS, **errors(403)})  # 403: max_live_models
def load_weights(body: LoadWeightsRequest, request: Request, db: DbDep, settings: SettingsDep,
                 who: CallerDep) -> ModelFuture:
    if body.session_id is None:  # legacy addressing: an existing model
        if body.model_id is None or body.seq_id is None:
            raise InvalidArgumentError("load_weights: give session_id + model_seq_id (new model) or model_id + seq_id")
        check_seq_id(body.seq_id, "load_weights")
        require_owned_model(db, body.model_id, who)
        check_inflight(db, who)
        with consumes_seq_id(request, db, model_id=body.model_id, seq_id=body.seq_id, request_type="load_weights"):
            path, meta = _training_checkpoint(db, body.path, who)
            check_existing_model_optimizer(body, meta, stored_optimizer(db, body.model_id))
        job: dict[str, Any] = {"path": str(path), "optimizer": body.optimizer}
        future_id = submit_future(request, db, future_id=f"{body.model_id}:{body.seq_id}", request_type="load_weights",
                                  body={"model_id": body.model_id, **job}, model_id=body.model_id, seq_id=body.seq_id)
        return ModelFuture(request_id=future_id, model_id=body.model_id)
    check_model_seq_id(body.model_seq_id or 0, "load_weights")
    check_json_finite(body.user_metadata, "user_metadata", "load_weights")
    path, meta = _training_checkpoint(db, body.path, who)
    job = {"path": str(path), "optimizer": body.optimizer}
    session = owned_session(db, body.session_id, who, f"load_weights: session {body.session_id!r} not found; "
                            "create a session first")
    base_model = body.base_model or meta.base_model
    if not settings.serves(base_model):
        raise InvalidArgumentError(f"load_weights: the checkpoint's base model {base_model!r} is not served here "
                                   "(start the server with it as --base-model or --model-alias)")
    model_id = f"{body.session_id}:train:{body.model_seq_id or 0}"
    lora = {"rank": meta.lora_rank, "seed": meta.seed, "train_attn": meta.train_attn, "train_mlp": meta.train_mlp,
            "train_unembed": meta.train_unembed}
    optimizer = load_optimizer(body, meta)
    if optimizer != "adamw":
        lora["optimizer"] = optimizer
    if db.get(ModelRecord, model_id) is None:  # a retry of a create that got through is no new model
        check_live_models(db, who)
        check_inflight(db, who)
        record = ModelRecord(id=model_id, session_id=body.session_id, owner_key_id=session.owner_key_id,
                             base_model=base_model, lora_rank=meta.lora_rank, lora_config=lora,
                             user_metadata=body.user_metadata or {})
    else:
        record = None
    create = {"model_id": model_id, "lora_rank": meta.lora_rank, "seed": meta.seed or 0, "train_attn": meta.train_attn,
              "train_mlp": meta.train_mlp, "train_unembed": meta.train_unembed, "load": job,
              **({"optimizer": optimizer} if optimizer != "adamw" else {})}
    future_id = submit_future(request, db, future_id=f"{model_id}:create", request_type="create_model", body=create,
                              session_id=body.session_id, extra_rows=(record,) if record else ())
    return ModelFuture(request_id=future_id, model_id=model_id)


@router.post("/weights_info", responses=errors(404))
def weights_info(body: WeightsInfoRequest, db: DbDep, who: CallerDep) -> WeightsInfoResponse:
    path = TinkerPath.parse(body.tinker_path, "weights_info: tinker_path")
    _, meta = checkpoint_meta(db, path, who, "weights_info")
    return WeightsInfoResponse.model_validate(
        {"base_model": meta.base_model, "is_lora": meta.is_lora, "lora_rank": meta.lora_rank or None,
         "train_unembed": meta.train_unembed, "train_mlp": meta.train_mlp, "train_attn": meta.train_attn,
         "optimizer_config": OPTIMIZER_CONFIGS.get(meta.optimizer, {"type": meta.optimizer})})


def load_optimizer(body: LoadWeightsRequest, meta: ModelMeta) -> str:
    """A model created from a checkpoint: with its optimizer state, the checkpoint's optimizer (optimizer_config
    may only repeat it); weights only, optimizer_config's (AdamW by default)."""
    kind = optimizer_kind(body.optimizer_config, "load_weights")
    if body.optimizer:
        if body.optimizer_config is not None and kind != meta.optimizer:
            raise InvalidArgumentError(f"load_weights: optimizer_config.type {kind!r} cannot override the restored "
                                       f"{meta.optimizer} optimizer state; load the weights only to change optimizer")
        kind = meta.optimizer
    if kind != "adamw" and not meta.is_lora:
        raise InvalidArgumentError(f"load_weights: optimizer_config.type {kind!r} updates LoRA factors; full "
                                   "fine-tuning (lora rank 0) uses adamw")
    return kind


def check_existing_model_optimizer(body: LoadWeightsRequest, meta: ModelMeta, model_kind: str) -> None:
    """A load into an existing model keeps its optimizer: optimizer_config may only repeat it, and optimizer
    state must be of its family."""
    if body.optimizer_config is not None and optimizer_kind(body.optimizer_config, "load_weights") != model_kind:
        raise InvalidArgumentError(f"load_weights: optimizer_config cannot change the optimizer of existing model "
                                   f"{body.model_id} ({model_kind})")
    if body.optimizer and meta.optimizer != model_kind:
        raise InvalidArgumentError(f"load_weights: the checkpoint holds {meta.optimizer} optimizer state, but model "
                                   f"{body.model_id} uses {model_kind}; load the weights only (optimizer=False)")
