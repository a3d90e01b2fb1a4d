"""Response bodies of the Tinker routes (what /openapi.json describes, field names as the tinker SDK's types) and
the shared table of error responses."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class ErrorBody(BaseModel):
    """Every refusal of a Tinker route (api/errors.py error_response); `detail` repeats `message` for clients
    that read FastAPI's usual field."""

    type: str = Field(description="the error code: invalid_argument, not_found, conflict, gone, resource_exhausted, "
                                  "quota_exceeded, unauthenticated, unimplemented or internal")
    message: str
    detail: str


_ERROR_DESCRIPTIONS = {
    400: "Invalid argument (a malformed body included): the message names the field and the fix",
    401: "Missing, unknown or revoked API key (only with --auth keys)",
    403: "The API key's max_live_models quota is used up: not retried, since waiting frees no slot (unload a model or "
         "end its session first)",
    404: "Not found (another API key's objects are not found either)",
    409: "Conflict: the id was already used by a different request, or the object is busy (retry)",
    410: "Gone: the session has ended (finished, or silent past the session timeout)",
    413: "The request body exceeds the server's limit (--max-request-bytes): send fewer datums per call",
    429: "The API key's quota is used up: retry after Retry-After seconds",
    500: "Internal error (logged by the server; never a stack trace)",
    501: "Not implemented by this server",
    503: "The server cannot serve this now (the engine failed, or a resource is exhausted)",
}
_RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "integer"}}}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The `responses=` entries of these error statuses, all with the ErrorBody shape."""
    table: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        entry: dict[str, Any] = {"model": ErrorBody, "description": _ERROR_DESCRIPTIONS[status]}
        if status == 429:
            entry["headers"] = _RETRY_AFTER
        table[status] = entry
    return table


# Every route behind the API-key check can answer these; routes with a body (or query parameters) also 400 and 413.
COMMON_ERRORS = errors(401, 500)
BODY_ERRORS = errors(400, 401, 413, 500)


class OptimizerConfig(BaseModel):
    """An optimizer family ({"type": "adamw"} or {"type": "dimuon", "version": 1})."""

    model_config = ConfigDict(extra="allow")
    type: str


# --- futures: what a submitted request answers at once (the SDK's UntypedAPIFuture) ---

class RequestFuture(BaseModel):
    request_id: str = Field(description="poll it with retrieve_future")


class ModelFuture(RequestFuture):
    model_id: str


class SampleFuture(RequestFuture):
    sample_sequence_ids: list[str] = Field(description="one per requested sample, in the result's order")


class TryAgain(BaseModel):
    """retrieve_future's answer when the long poll ended before the request finished: poll again."""

    type: Literal["try_again"]
    request_id: str
    queue_state: Literal["active", "paused_capacity", "paused_rate_limit"]
    queue_state_reason: str | None = Field(default=None, description="why the request waits (paused states only)")


class RequestFailed(BaseModel):
    """retrieve_future's answer for a request that failed (the engine refused or could not run it)."""

    error: str
    category: Literal["user", "server", "unknown"]


# Non-finite floats travel as these strings (finite_json.py); the SDK's pydantic reads them back as floats.
FiniteFloat = float | Literal["NaN", "Infinity", "-Infinity"]


class TensorData(BaseModel):
    data: list[FiniteFloat]
    dtype: str
    shape: list[int]


class ForwardBackwardResult(BaseModel):
    """A forward / forward_backward result as JSON (clients that do not accept protobuf)."""

    loss_fn_output_type: str
    loss_fn_outputs: list[dict[str, TensorData]]
    metrics: dict[str, FiniteFloat]


class CancelFutureResponse(BaseModel):
    request_id: str
    cancelled: bool = Field(description="true: the request will never run")
    status: str = Field(description="the request's status now: failed (cancelled), running or completed")
    message: str


class FutureCompletion(BaseModel):
    state: Literal["finished", "failed"]
    request_id: str


class FuturesRetrieveResponse(BaseModel):
    completions: list[FutureCompletion]
    cursor: int = Field(description="send it back as prev_cursor on the next poll")


# --- service ---

class ClientConfigResponse(BaseModel):
    pjwt_auth_enabled: bool
    proto_compress_fwdbwd: bool
    sample_use_retrieve_futures: bool
    custom_loss_server_side: bool
    sample_join_sampling_session: bool


class ClientDynamicConfigResponse(BaseModel):
    refresh_interval_sec: int
    sample_cancel_enabled: bool


class CreateSessionResponse(BaseModel):
    session_id: str


class EmptyResponse(BaseModel):
    """An empty JSON object."""


class TelemetryResponse(BaseModel):
    status: Literal["accepted"]


class SupportedModel(BaseModel):
    model_name: str
    trainable: bool
    sampleable: bool
    max_context_length: int


class ServerCapabilitiesResponse(BaseModel):
    supported_models: list[SupportedModel]
    supported_optimizers: list[OptimizerConfig]


class HealthResponse(BaseModel):
    status: Literal["ok", "failed"]
    engine: str = Field(description="the engine mode: process, thread or external")
    engine_pid: int | None
    engine_restarts: int
    engine_ready: bool = Field(description="false while the engine loads the base model (requests wait meanwhile)")


class HealthFailedResponse(HealthResponse):
    message: str


# --- training clients, checkpoints ---

class ModelData(BaseModel):
    arch: str
    model_name: str
    tokenizer_id: str


class GetInfoResponse(BaseModel):
    model_id: str
    model_data: ModelData
    is_lora: bool
    lora_rank: int | None
    model_name: str
    optimizer_config: OptimizerConfig


class WeightsInfoResponse(BaseModel):
    base_model: str
    is_lora: bool
    lora_rank: int | None
    train_unembed: bool
    train_mlp: bool
    train_attn: bool
    optimizer_config: OptimizerConfig


class CopyWeightsResponse(BaseModel):
    tinker_path: str


# --- sampling clients ---

class CreateSamplingSessionResponse(BaseModel):
    sampling_session_id: str


class GetSamplerResponse(BaseModel):
    sampler_id: str
    base_model: str
    model_path: str | None


class JoinSamplingSessionResponse(BaseModel):
    type: Literal["join_sampling_session"]
    client_counter: int


# --- REST: training runs, checkpoints, sessions ---

class Checkpoint(BaseModel):
    checkpoint_id: str
    checkpoint_type: Literal["training", "sampler", "external"]
    time: datetime
    tinker_path: str
    size_bytes: int | None
    public: bool
    user_metadata: dict[str, str] | None
    expires_at: datetime | None


class Cursor(BaseModel):
    offset: int
    limit: int
    total_count: int


class CheckpointsListResponse(BaseModel):
    checkpoints: list[Checkpoint]
    cursor: Cursor | None


class TrainingRun(BaseModel):
    training_run_id: str
    base_model: str
    model_owner: str
    is_lora: bool
    lora_rank: int | None
    corrupted: bool
    last_request_time: datetime
    last_checkpoint: Checkpoint | None
    last_sampler_checkpoint: Checkpoint | None
    user_metadata: dict[str, str] | None


class TrainingRunsResponse(BaseModel):
    training_runs: list[TrainingRun]
    cursor: Cursor


class ExternalWeightsUrlsResponse(BaseModel):
    urls: dict[str, str] = Field(description="a signed download URL per file of the checkpoint")
    expires: datetime


class SessionActive(BaseModel):
    type: Literal["active"]


class FinishReasonBody(BaseModel):
    type: Literal["success", "errored", "interrupted"]


class SessionClientFinished(BaseModel):
    type: Literal["client_finished"]
    reason: FinishReasonBody
    detail: str | None


class SessionSummary(BaseModel):
    session_id: str
    created_at: datetime
    owner: str
    project_id: str
    status: SessionActive | SessionClientFinished | None = Field(
        description="null for a session ended by the session timeout")
    checkpoints_count: int
    checkpoint_storage_bytes: int
    display_name: str | None
    user_metadata: dict[str, str] | None


class SessionSearchCursorBody(BaseModel):
    last_created_at: datetime
    last_session_id: str


class SessionSearchResponse(BaseModel):
    sessions: list[SessionSummary]
    next_cursor: SessionSearchCursorBody | None = Field(description="send it as the next request's cursor")
