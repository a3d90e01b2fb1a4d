"""Training endpoints: create_model, get_info, forward / forward_backward, optim_step, unload_model."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import Connection, select

from skyrl_tx.api.deps import DbDep, SettingsDep, in_db
from skyrl_tx.api.optimizers import OPTIMIZER_CONFIGS, model_optimizer, optim_job, optimizer_kind, stored_optimizer
from skyrl_tx.api.ownership import (check_inflight, check_live_models, owned_live_model, owned_session,
                                    require_owned_model)
from skyrl_tx.api.principal import CallerDep
from skyrl_tx.api.provenance import check_provenance
from skyrl_tx.api.responses import BODY_ERRORS, GetInfoResponse, ModelFuture, errors
from skyrl_tx.api.routes.custom_losses import check_custom_loss_config
from skyrl_tx.api.submit import consumes_seq_id, record_unusable_body, submit_future
from skyrl_tx.api.validation import (check_datums, check_finite_mapping, check_json_finite,
                                     check_model_seq_id, check_seed, check_seq_id)
from skyrl_tx.db.models import ModelRecord
from skyrl_tx.errors import InvalidArgumentError
from skyrl_tx.types import LOSS_FUNCTIONS, AdamParams
from skyrl_tx.wire.codec import decode_forward_backward_request

router = APIRouter(prefix="/api/v1", responses=BODY_ERRORS)
SUBMIT_ERRORS = errors(404, 409, 429)  # unknown model; an id reused with another body; a key's quota
# forward_backward's body is the SDK's ForwardBackwardRequest protobuf (zstd-compressed when Content-Encoding says so)
PROTOBUF_BODY = {"requestBody": {"required": True, "content": {"application/x-protobuf": {
    "schema": {"type": "string", "format": "binary", "description": "a tinker ForwardBackwardRequest"}}}}}


class LoraConfigBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    rank: int = 32
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class CreateModelRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    session_id: str
    model_seq_id: int = 0
    base_model: str
    lora_config: LoraConfigBody = Field(default_factory=LoraConfigBody)
    optimizer_config: dict[str, Any] | None = None
    user_metadata: dict[str, Any] | None = None


class ModelRef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model_id: str


class OptimStepRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model_id: str
    seq_id: int
    adam_params: AdamParams | None = None  # the shared dataclass; pydantic validates its fields
    optimizer_params: dict[str, Any] | None = None  # non-Adam families (DimuonParams); api/optimizers.py checks


@router.post("/create_model", responses={**SUBMIT_ERRORS, **errors(403)})  # 403: max_live_models
def create_model(body: CreateModelRequest, request: Request, db: DbDep, settings: SettingsDep,
                 who: CallerDep) -> ModelFuture:
    session = owned_session(db, body.session_id, who, f"create_model: session {body.session_id!r} not found; "
                            "create a session first")
    check_model_seq_id(body.model_seq_id, "create_model")
    check_seed(body.lora_config.seed, "create_model", "lora_config.seed")
    check_json_finite(body.user_metadata, "user_metadata", "create_model")
    if not settings.serves(body.base_model):
        served = ", ".join(settings.served_names())
        raise InvalidArgumentError(f"create_model: base_model {body.base_model!r} is not served here (serving: "
                                   f"{served}); start the server with --base-model or --model-alias for it")
    rank, max_rank = body.lora_config.rank, settings.backend.max_lora_rank
    if rank < 0 or rank > max_rank:
        raise InvalidArgumentError(f"create_model: lora rank {rank} is outside [0, {max_rank}] (0 = full fine-tuning); "
                                   "restart the server with a larger max_lora_rank in --backend-config")
    optimizer = optimizer_kind(body.optimizer_config, "create_model")
    if optimizer != "adamw" and rank == 0:
        raise InvalidArgumentError(f"create_model: optimizer_config.type {optimizer!r} updates LoRA factors; full "
                                   "fine-tuning (lora rank 0) uses adamw")
    model_id = f"{body.session_id}:train:{body.model_seq_id}"  # the SDK derives ids of this shape itself
    lora = body.lora_config.model_dump()
    if optimizer != "adamw":  # kept with the model (and sent to the engine) for its whole life
        lora["optimizer"] = optimizer
    if db.get(ModelRecord, model_id) is None:  # a retry of a create that got through is no new model
        check_live_models(db, who)
        check_inflight(db, who)
        record = ModelRecord(id=model_id, session_id=body.session_id, owner_key_id=session.owner_key_id,
                             base_model=body.base_model, lora_rank=rank, lora_config=lora,
                             user_metadata=body.user_metadata or {})
    else:
        record = None
    job = {"model_id": model_id, "lora_rank": rank, **{k: v for k, v in lora.items() if k != "rank"}}
    future_id = submit_future(request, db, future_id=f"{model_id}:create", request_type="create_model", body=job,
                              session_id=body.session_id, extra_rows=(record,) if record else ())
    return ModelFuture(request_id=future_id, model_id=model_id)


@router.post("/get_info", responses=errors(404))
def get_info(body: ModelRef, request: Request, db: DbDep, who: CallerDep) -> GetInfoResponse:
    model = owned_live_model(db, body.model_id, who)
    model_data = {"arch": request.app.state.architecture, "model_name": model.base_model,
                  "tokenizer_id": str(request.app.state.model_dir)}
    return GetInfoResponse.model_validate(
        {"model_id": model.id, "model_data": model_data, "is_lora": model.lora_rank > 0,
         "lora_rank": model.lora_rank or None, "model_name": model.base_model,
         "optimizer_config": OPTIMIZER_CONFIGS[model_optimizer(model.lora_config)]})


@router.post("/forward_backward", responses=SUBMIT_ERRORS, openapi_extra=PROTOBUF_BODY)
async def forward_backward(request: Request, who: CallerDep) -> ModelFuture:
    raw = await request.body()
    encoding = request.headers.get("content-encoding")

    def store(db: Connection) -> ModelFuture:
        try:  # decoding (zstd + protobuf) is CPU work: off the event loop, in the same hop as the database
            # Decompressed size capped at the body limit, checked while inflating: a small zstd bomb stops early.
            decoded = decode_forward_backward_request(raw, encoding,
                                                      max_bytes=request.app.state.settings.max_request_bytes)
        except ValueError as exc:
            error = InvalidArgumentError(f"forward_backward: cannot decode the request body: {exc}")
            record_unusable_body(request, raw, encoding, error)  # its seq_id, if its first fields name one
            raise error from exc
        model_id, seq_id = decoded["model_id"], decoded["seq_id"]
        kind = "forward" if decoded["forward_only"] else "forward_backward"
        check_seq_id(seq_id, kind)
        require_owned_model(db, model_id, who)
        check_inflight(db, who)  # outside consumes_seq_id: the SDK retries a 429 with the same seq_id
        with consumes_seq_id(request, db, model_id=model_id, seq_id=seq_id, request_type=kind):
            if decoded["loss_fn"] == "custom":  # a graph from create_custom_loss, run in this pass
                session_id = db.execute(select(ModelRecord.session_id).where(ModelRecord.id == model_id)).scalar_one()
                check_custom_loss_config(db, decoded["loss_fn_config"], session_id, kind)
            else:
                if decoded["loss_fn"] not in LOSS_FUNCTIONS:
                    raise InvalidArgumentError(f"{kind}: loss_fn {decoded['loss_fn']!r} is not supported; use one "
                                               f"of {', '.join(LOSS_FUNCTIONS)}, or 'custom' with a loss from "
                                               "ServiceClient.create_custom_loss")
                check_finite_mapping(decoded["loss_fn_config"], "loss_fn_config", kind)
            check_datums(decoded["data"], request.app.state.max_positions, kind)
            check_provenance(db, decoded["data"], kind, decoded["loss_fn"], model_id)  # spans and records
        # The datums stay in the SDK's protobuf, stored (and hashed) as bytes; the JSON holds the metadata.
        job = {"model_id": model_id, "loss_fn": decoded["loss_fn"], "loss_fn_config": decoded["loss_fn_config"]}
        future_id = submit_future(request, db, future_id=f"{model_id}:{seq_id}", request_type=kind, body=job,
                                  model_id=model_id, seq_id=seq_id, binary_body=decoded["body"])
        tokens = sum(len(d["input_tokens"]) for d in decoded["data"])
        request.app.state.key_metrics.accepted(future_id, "trained", tokens)  # counted once it ran (/metrics)
        return ModelFuture(request_id=future_id, model_id=model_id)

    return await in_db(request, store)


@router.post("/optim_step", responses=SUBMIT_ERRORS)
async def optim_step(body: OptimStepRequest, request: Request, who: CallerDep) -> ModelFuture:
    check_seq_id(body.seq_id, "optim_step")

    def store(db: Connection) -> ModelFuture:
        require_owned_model(db, body.model_id, who)
        check_inflight(db, who)
        with consumes_seq_id(request, db, model_id=body.model_id, seq_id=body.seq_id, request_type="optim_step"):
            job = optim_job(body.model_id, stored_optimizer(db, body.model_id), body.adam_params,
                            body.optimizer_params)
        future_id = submit_future(request, db, future_id=f"{body.model_id}:{body.seq_id}",
                                  request_type="optim_step", body=job, model_id=body.model_id, seq_id=body.seq_id)
        return ModelFuture(request_id=future_id, model_id=body.model_id)

    return await in_db(request, store)


@router.post("/unload_model", responses=errors(404, 409))
def unload_model(body: ModelRef, request: Request, db: DbDep, who: CallerDep) -> ModelFuture:
    require_owned_model(db, body.model_id, who)
    future_id = submit_future(request, db, future_id=f"{body.model_id}:unload", request_type="unload_model",
                              body={"model_id": body.model_id}, model_id=body.model_id)
    return ModelFuture(request_id=future_id, model_id=body.model_id)
