"""Service endpoints: client config, sessions and heartbeats, telemetry, capabilities, health."""

from __future__ import annotations

import uuid
from datetime import datetime, timezone
from typing import Any, Literal

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from skyrl_tx.api.deps import DbDep, SettingsDep
from skyrl_tx.api.optimizers import OPTIMIZER_CONFIGS
from skyrl_tx.api.ownership import owned_session
from skyrl_tx.api.principal import CallerDep, Principal
from skyrl_tx.api.responses import (BODY_ERRORS, COMMON_ERRORS, ClientConfigResponse, ClientDynamicConfigResponse,
                                     CreateSessionResponse, EmptyResponse, HealthFailedResponse, HealthResponse,
                                     ServerCapabilitiesResponse, TelemetryResponse, errors)
from skyrl_tx.api.request_ids import REQUEST_ID
from skyrl_tx.api.validation import check_json_finite
from skyrl_tx.db import audit
from skyrl_tx.db.models import SessionRecord, SessionStatus
from skyrl_tx.db.unload_requests import request_unloads
from skyrl_tx.errors import GoneError

router = APIRouter(prefix="/api/v1")  # error responses per route: healthz is open (no 401)


class CreateSessionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    tags: list[str] = Field(default_factory=list)
    user_metadata: dict[str, Any] = Field(default_factory=dict)
    sdk_version: str | None = None
    project_id: str | None = None
    display_name: str | None = None


class FinishReason(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["success", "errored", "interrupted"]


class FinishSessionRequest(BaseModel):
    """What ServiceClient.close(status, detail) sends (older SDKs send nothing)."""

    model_config = ConfigDict(extra="ignore")
    reason: FinishReason | None = None
    detail: str | None = None


class SessionRef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    session_id: str


@router.post("/client/config", responses=COMMON_ERRORS)
def client_config(settings: SettingsDep) -> ClientConfigResponse:
    # zstd-compressed protobuf forward_backward bodies; samples wait on one retrieve_futures poll per sampling
    # client (routes/futures_batch.py) only where the server was started with --sample-retrieve-futures
    # (config.py says why it is off by default); copies of a sampling client get their number from the server
    # (routes/sampling_clients.py); custom losses run on the server, in one pass (routes/custom_losses.py).
    return ClientConfigResponse(pjwt_auth_enabled=False, proto_compress_fwdbwd=True,
                                sample_use_retrieve_futures=settings.sample_retrieve_futures,
                                custom_loss_server_side=True, sample_join_sampling_session=True)


@router.post("/client/dynamic_config", responses=COMMON_ERRORS)
def dynamic_config() -> ClientDynamicConfigResponse:
    # A sample the client stops waiting for is cancelled (routes/futures.py cancel_future): if still queued, it
    # never runs.
    return ClientDynamicConfigResponse(refresh_interval_sec=300, sample_cancel_enabled=True)


@router.post("/create_session", responses=BODY_ERRORS)
def create_session(body: CreateSessionRequest, db: DbDep, who: CallerDep) -> CreateSessionResponse:
    # Session ids appear inside model ids ("<session>:train:<n>") and URLs: no ':' and no '/'.
    check_json_finite(body.user_metadata, "user_metadata", "create_session")
    session_id = uuid.uuid4().hex
    db.add(SessionRecord(id=session_id, tags=body.tags, user_metadata=body.user_metadata,
                         sdk_version=body.sdk_version, owner_key_id=who.key_id, project_id=body.project_id,
                         display_name=body.display_name))
    db.commit()
    return CreateSessionResponse(session_id=session_id)


def _session(db: DbDep, session_id: str, who: Principal) -> SessionRecord:
    return owned_session(db, session_id, who, f"session {session_id!r} not found; create one with create_session")


@router.post("/session_heartbeat", responses={**BODY_ERRORS, **errors(404, 410)})
def session_heartbeat(body: SessionRef, db: DbDep, who: CallerDep) -> EmptyResponse:
    session = _session(db, body.session_id, who)
    if session.status != SessionStatus.ACTIVE.value:  # the SDK stops heartbeating on a 410
        raise GoneError(f"session {body.session_id!r} has ended (finished, or silent past the session timeout); "
                        "its models were unloaded: start a new ServiceClient")
    session.last_heartbeat_at = datetime.now(timezone.utc)
    db.commit()
    return EmptyResponse()


@router.post("/sessions/{session_id}/finish", status_code=204, responses={**BODY_ERRORS, **errors(404)})
def finish_session(session_id: str, request: Request, db: DbDep, who: CallerDep,
                   body: FinishSessionRequest | None = None) -> Response:
    """The session ends: its models are unloaded once their accepted requests and samples are done, so their
    adapter slots are free for the next user at once (not at the session timeout). The client's finish reason is
    kept for sessions/search; the first one given stays (the SDK's close() is first-wins)."""
    session = _session(db, session_id, who)
    session.status = SessionStatus.EXPIRED.value
    if body is not None and body.reason is not None and session.finish_reason is None:
        session.finish_reason, session.finish_detail = body.reason.type, body.detail
    unloads = request_unloads(db, session_id)
    for model_id in unloads:  # audited as unload_model requests are (api/submit.py), in the same transaction
        audit.record(db, "model_unload", actor=who.key_id, owner=session.owner_key_id, resource=model_id,
                     request_id=REQUEST_ID.get(), details={"model_id": model_id, "reason": "session_finish",
                                                           "session_id": session_id})
    db.commit()
    if unloads:
        request.app.state.wake_engine()
    return Response(status_code=204)


@router.post("/telemetry", responses=COMMON_ERRORS)
def telemetry() -> TelemetryResponse:
    return TelemetryResponse(status="accepted")


@router.get("/get_server_capabilities", responses=COMMON_ERRORS)
def server_capabilities(request: Request, settings: SettingsDep) -> ServerCapabilitiesResponse:
    """Every name of the base model (aliases and its directory are the same weights, so they answer alike)."""
    model = {
        # Every configuration trains (max_lora_adapters >= 1 is validated) and samples (the built-in sampler, or
        # vLLM with --external-inference-url) its one base model.
        "trainable": True, "sampleable": True,
        # The context every request gets: training sequences are bounded by the model's positions, sampled ones
        # (prompt + completion) also by max_sampling_length.
        "max_context_length": min(request.app.state.max_positions, settings.backend.max_sampling_length)}
    return ServerCapabilitiesResponse.model_validate(
        {"supported_models": [{"model_name": name, **model} for name in settings.served_names()],
         "supported_optimizers": list(OPTIMIZER_CONFIGS.values())})  # not in the SDK's model (it ignores it)


@router.get("/healthz", response_model=HealthResponse,
            responses={503: {"model": HealthFailedResponse, "description": "The engine could not start"}})
def healthz(request: Request) -> Any:
    """Answers from the first moment the server listens. `engine_ready` is false while the engine loads the base
    model and rebuilds the live models: requests are accepted meanwhile and run once it is ready."""
    engine, failed = request.app.state.engine, request.app.state.engine_failed
    body = {"status": "failed" if failed else "ok", "engine": request.app.state.settings.engine,
            "engine_pid": engine.pid, "engine_restarts": engine.restarts,
            "engine_ready": engine.ready.is_set() and not failed}
    if failed:
        return JSONResponse(status_code=503, content={**body, "message": failed})
    return body
