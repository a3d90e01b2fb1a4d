"""Sampling endpoints: save_weights_for_sampler, create_sampling_session, samplers/{id}, asample."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import Connection

from skyrl_tx.api.deps import DbDep, SettingsDep, in_db
from skyrl_tx.api.ownership import check_inflight, owned_live_model, owned_sampler, owned_session, readable_checkpoint
from skyrl_tx.api.principal import CallerDep
from skyrl_tx.api.responses import (BODY_ERRORS, COMMON_ERRORS, CreateSamplingSessionResponse, GetSamplerResponse,
                                     ModelFuture, SampleFuture, errors)
from skyrl_tx.api.sample_fields import sample_field_job
from skyrl_tx.api.submit import consumes_seq_id, submit_future
from skyrl_tx.api.validation import check_model_seq_id, check_sample_request, check_sampling_params, check_seq_id
from skyrl_tx.api.routes.checkpoints import check_ttl
from skyrl_tx.checkpoints.formats import ModelMeta
from skyrl_tx.checkpoints.paths import TinkerPath, validate_name
from skyrl_tx.db.completion_queues import queue_of_sample
from skyrl_tx.db.models import SamplingSessionRecord
from skyrl_tx.errors import InvalidArgumentError
from skyrl_tx.wire.codec import TEXT_ONLY

router = APIRouter(prefix="/api/v1")


class SaveForSamplerRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model_id: str
    seq_id: int
    path: str | None = None
    sampling_session_seq_id: int | None = None
    kind: str = "snapshot"
    ttl_seconds: int | None = None
    user_metadata: dict[str, str] | None = None


class CreateSamplingSessionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    session_id: str
    sampling_session_seq_id: int
    base_model: str | None = None
    model_path: str | None = None


class SamplingParamsBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    max_tokens: int | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None


class Chunk(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str = "encoded_text"
    tokens: list[int] = Field(default_factory=list)


class ModelInputBody(BaseModel):
    chunks: list[Chunk]


class SampleBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    sampling_session_id: str
    seq_id: int
    num_samples: int = 1
    prompt: ModelInputBody
    sampling_params: SamplingParamsBody = Field(default_factory=SamplingParamsBody)
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = None
    target_prompt_logprobs: dict[str, Any] | None = None
    # Keep this sample as a stability record that stable_reinforce datums name by sequence_id (api/provenance.py).
    record_stability_info: bool | None = None


def _check_kind(body: SaveForSamplerRequest, what: str) -> None:
    """kind "snapshot" freezes the weights for the new client; "inflight" makes the client follow the model's newest
    inflight save (one mutable target per training model). Inflight saves are unnamed and never expire."""
    if body.kind not in ("snapshot", "inflight"):
        raise InvalidArgumentError(f"{what}: kind must be 'snapshot' or 'inflight', not {body.kind!r}")
    if body.kind == "inflight" and (body.path or body.sampling_session_seq_id is None):
        raise InvalidArgumentError(f"{what}: kind 'inflight' saves are unnamed: send sampling_session_seq_id and no "
                                   "path (TrainingClient.save_weights_and_get_sampling_client(kind='inflight'))")
    if body.kind == "inflight" and body.ttl_seconds is not None:
        raise InvalidArgumentError(f"{what}: ttl_seconds does not apply to kind 'inflight' (the target lives as "
                                   "long as its training model); leave it out")


@router.post("/save_weights_for_sampler", responses={**BODY_ERRORS, **errors(404, 409, 429)})
def save_weights_for_sampler(body: SaveForSamplerRequest, request: Request, db: DbDep,
                             who: CallerDep) -> ModelFuture:
    what = "save_weights_for_sampler"
    check_seq_id(body.seq_id, what)
    model = owned_live_model(db, body.model_id, who)
    check_inflight(db, who)
    job: dict[str, Any] = {"model_id": body.model_id}
    with consumes_seq_id(request, db, model_id=body.model_id, seq_id=body.seq_id, request_type=what):
        _check_kind(body, what)
        if body.sampling_session_seq_id is not None:  # ephemeral: a snapshot bound to a new sampling session
            check_model_seq_id(body.sampling_session_seq_id, what, "sampling_session_seq_id")
            job["sampling_session_id"] = f"{model.session_id}:sample:{body.sampling_session_seq_id}"
            job["inflight"] = body.kind == "inflight"
        elif body.path:
            name = validate_name(body.path, what)
            check_ttl(body.ttl_seconds, what)
            job |= {"path": str(TinkerPath(body.model_id, "sampler_weights", name)), "ttl_seconds": body.ttl_seconds,
                    "user_metadata": body.user_metadata}
        else:
            raise InvalidArgumentError(f"{what}: give a name (path) or a sampling_session_seq_id")
    future_id = submit_future(request, db, future_id=f"{body.model_id}:{body.seq_id}",
                              request_type="save_weights_for_sampler", body=job, model_id=body.model_id,
                              seq_id=body.seq_id)
    return ModelFuture(request_id=future_id, model_id=body.model_id)


@router.post("/create_sampling_session", responses={**BODY_ERRORS, **errors(404)})
def create_sampling_session(body: CreateSamplingSessionRequest, db: DbDep, settings: SettingsDep,
                            who: CallerDep) -> CreateSamplingSessionResponse:
    owned_session(db, body.session_id, who, f"create_sampling_session: session {body.session_id!r} not found")
    check_model_seq_id(body.sampling_session_seq_id, "create_sampling_session", "sampling_session_seq_id")
    sampler_id = f"{body.session_id}:sample:{body.sampling_session_seq_id}"
    if db.get(SamplingSessionRecord, sampler_id) is not None:  # a retry
        return CreateSamplingSessionResponse(sampling_session_id=sampler_id)
    snapshot_id, model_id, base_model = None, None, body.base_model or settings.base_model
    if body.model_path:
        path = TinkerPath.parse(body.model_path, "create_sampling_session: model_path")
        if path.kind != "sampler_weights":
            raise InvalidArgumentError(f"create_sampling_session: {path} is a {path.checkpoint_type} checkpoint; "
                                       "sample from sampler weights (save_weights_for_sampler)")
        record = readable_checkpoint(db, path, who, "create_sampling_session")  # its own, or a published one
        meta = ModelMeta.from_json(record.model_meta)
        snapshot_id, model_id, base_model = str(path), record.model_id, meta.base_model
    elif not settings.serves(base_model):
        raise InvalidArgumentError(f"create_sampling_session: base_model {base_model!r} is not served here")
    db.add(SamplingSessionRecord(id=sampler_id, session_id=body.session_id, base_model=base_model,
                                 model_path=body.model_path, model_id=model_id, snapshot_id=snapshot_id))
    db.commit()
    return CreateSamplingSessionResponse(sampling_session_id=sampler_id)


@router.get("/samplers/{sampler_id:path}", responses={**COMMON_ERRORS, **errors(404)})
def get_sampler(sampler_id: str, db: DbDep, who: CallerDep) -> GetSamplerResponse:
    owned_sampler(db, sampler_id, who, f"sampler {sampler_id!r} not found")
    sampler = db.get(SamplingSessionRecord, sampler_id)
    return GetSamplerResponse(sampler_id=sampler.id, base_model=sampler.base_model, model_path=sampler.model_path)


@router.post("/asample", responses={**BODY_ERRORS, **errors(404, 409, 429)})
async def asample(body: SampleBody, request: Request, who: CallerDep) -> SampleFuture:
    check_model_seq_id(body.seq_id, "asample", "seq_id")  # part of the future's id only: any signed 64-bit value
    if any(c.type != "encoded_text" for c in body.prompt.chunks):
        kind = next(c.type for c in body.prompt.chunks if c.type != "encoded_text")
        raise InvalidArgumentError(f"asample: prompt chunk type {kind!r}: {TEXT_ONLY}")
    stop = body.sampling_params.stop
    params = body.sampling_params.model_dump()
    check_sampling_params(params)
    prompt_tokens = [t for c in body.prompt.chunks for t in c.tokens]
    check_sample_request(prompt_tokens, body.num_samples, body.topk_prompt_logprobs)
    params["stop"] = [stop] if isinstance(stop, str) else stop
    new_fields = sample_field_job(body, len(prompt_tokens), request.app.state.settings.backend.max_logprobs_k)

    def store(db: Connection) -> SampleFuture:
        sampler = owned_sampler(db, body.sampling_session_id, who, f"asample: sampling session "
                                f"{body.sampling_session_id!r} not found; create a sampling client first")
        check_inflight(db, who)
        job = {"weights_id": sampler.snapshot_id or "",
               "prompt_tokens": prompt_tokens, "num_samples": body.num_samples,
               "sampling_params": params, "prompt_logprobs": body.prompt_logprobs,
               "topk_prompt_logprobs": body.topk_prompt_logprobs, **new_fields}
        future_id = submit_future(request, db, future_id=f"{body.sampling_session_id}:{body.seq_id}",
                                  request_type="sample", body=job, session_id=sampler.session_id,
                                  completion_queue=queue_of_sample(body.sampling_session_id, body.seq_id))
        request.app.state.key_metrics.accepted(future_id, "prefilled", len(prompt_tokens))  # counted once it ran
        return SampleFuture(request_id=future_id,
                            sample_sequence_ids=[f"{future_id}:{i}" for i in range(body.num_samples)])

    return await in_db(request, store)
