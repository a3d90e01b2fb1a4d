"""retrieve_future: long-polls a future; results as protobuf where the SDK asks for it, else JSON. cancel_future:
fails a request the engine has not claimed yet.

A forward / forward_backward result is stored as the SDK's ForwardBackwardOutput protobuf (engine/executor.py) and
sent as stored; JSON is made from it only for a client that does not accept protobuf."""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone
from typing import Any

from fastapi import APIRouter, Request, Response
from skyrl_tx.api.json_response import FiniteJSONResponse as JSONResponse  # results may hold NaN
from pydantic import BaseModel, ConfigDict

from skyrl_tx.api.ownership import OWNED_OUTCOME, OWNED_REQUEST
from skyrl_tx.api.principal import CallerDep, Principal
from skyrl_tx.api.trace.ring import ring_of
from skyrl_tx.api.responses import (BODY_ERRORS, CancelFutureResponse, ForwardBackwardResult, RequestFailed, TryAgain,
                                     errors)
from skyrl_tx.db import future_queries
from skyrl_tx.db.future_queries import RESULT_IN_DATABASE, FutureOutcome
from skyrl_tx.db.models import FutureStatus
from skyrl_tx.errors import ConflictError, NotFoundError
from skyrl_tx.wire.codec import decode_forward_backward_output, encode_forward_backward_output, encode_sample_response

router = APIRouter(prefix="/api/v1")
PROTOBUF = "application/x-protobuf"
RECHECK_S = 1.0  # safety net only: results normally arrive by notification
EXTERNAL_RECHECK_S = 0.05  # an external engine cannot notify this process: the database is the only signal


class RetrieveFutureRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    request_id: str
    allow_metadata_only: bool = False


class CancelFutureRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    request_id: str


# Made by the server itself, not numbered by the client: a create's model and an unload's slot must not be left half.
UNCANCELLABLE = ("create_model", "unload_model")


def _load(request: Request, future_id: str, who: Principal | None = None) -> FutureOutcome | None:
    """The future's status, request_type, result (the binary one where it has one) and error, never its request.
    With `who` (the first read of a poll): None as well where `who` does not see the future's owner; the owner is
    read in the same statement (api/ownership.py), and not at all where `who` sees everything."""
    with request.app.state.database.connect() as db:
        if who is None or who.admin:
            row = db.execute(future_queries.OUTCOME, {"id_": future_id}).one_or_none()
        else:
            row = db.execute(OWNED_OUTCOME, {"id_": future_id}).one_or_none()
            if row is not None and not who.sees(row.owner_key_id):
                row = None
    if row is None:
        return None
    result = row.result if row.result_body is None else bytes(row.result_body)  # a driver may hand a memoryview
    return FutureOutcome(future_id, row.status, row.request_type, result, row.error)


def _waiting_reason(request: Request, future_id: str) -> str | None:
    """Why a queued request has not run, when it waits for an earlier request of its model that has not arrived
    (the engine never skips a seq_id: engine/loop.py)."""
    with request.app.state.database.connect() as db:
        row = db.execute(future_queries.MODEL_SEQ, {"id_": future_id}).one_or_none()
        if row is None or row.model_id is None or row.seq_id is None:
            return None
        below = db.execute(future_queries.HIGHEST_SEQ_BELOW, {"model_id": row.model_id, "seq_id": row.seq_id}).scalar()
    if below is not None and below >= row.seq_id - 1:
        return None
    first = 1 if below is None else below + 1
    missing = f"seq_id {first}" if first == row.seq_id - 1 else f"seq_ids {first}..{row.seq_id - 1}"
    return (f"waiting for request {missing} of model {row.model_id}, which the server has not received; requests of a "
            "model run in seq_id order")


def _forward_backward_json(body: bytes) -> dict[str, Any]:
    output_type, outputs, metrics = decode_forward_backward_output(body)
    return {"loss_fn_output_type": output_type, "metrics": metrics,
            "loss_fn_outputs": [{k: {"data": v.tolist(), "dtype": "float32", "shape": [len(v)]} for k, v in out.items()}
                                for out in outputs]}


def _render(future: FutureOutcome, accept: str) -> Response:
    if future.status == FutureStatus.FAILED.value:
        error = future.error or {}
        return JSONResponse({"error": error.get("message", "request failed"), "category": error.get("category", "server")})
    result: Any = future.result
    wants_proto = PROTOBUF in accept
    if future.request_type in ("forward", "forward_backward"):
        if isinstance(result, bytes):  # the stored ForwardBackwardOutput: sent as it is
            return Response(result, media_type=PROTOBUF) if wants_proto else JSONResponse(_forward_backward_json(result))
        if wants_proto:  # a result stored as JSON before binary bodies (migration 0003)
            body = encode_forward_backward_output(result["loss_fn_outputs"], result["metrics"])
            return Response(body, media_type=PROTOBUF)
        outputs = [{k: {"data": v, "dtype": "float32", "shape": [len(v)]} for k, v in out.items()}
                   for out in result["loss_fn_outputs"]]
        return JSONResponse({"loss_fn_output_type": "ArrayRecord", "loss_fn_outputs": outputs,
                             "metrics": result["metrics"]})
    if future.request_type == "sample" and wants_proto:
        body = encode_sample_response(result["sequences"], result.get("prompt_logprobs"),
                                      result.get("topk_prompt_logprobs"),
                                      target_prompt_logprobs=result.get("target_prompt_logprobs"),
                                      prompt_alt_tokens=result.get("prompt_alt_tokens"),
                                      prompt_cache_hit_tokens=result.get("prompt_cache_hit_tokens", 0))
        return Response(body, media_type=PROTOBUF)
    return JSONResponse(result)


# What retrieve_future answers: a try_again, the failure, or the request's result (JSON, or protobuf where the client
# accepts application/x-protobuf for a forward / forward_backward / sample result). Results other than
# forward_backward's are the engine's JSON per request type (the SDK's response types), described as an object.
RETRIEVE_RESPONSES: dict[int | str, dict[str, Any]] = {**BODY_ERRORS, **errors(404), 200: {
    "description": "try_again (poll again), the request's failure, or its result",
    "model": TryAgain | RequestFailed | ForwardBackwardResult | dict[str, Any],
    "content": {PROTOBUF: {"schema": {"type": "string", "format": "binary", "description":
                                      "a tinker ForwardBackwardOutput or SampleResponse protobuf"}}}}}


@router.post("/retrieve_future", response_model=None, responses=RETRIEVE_RESPONSES)
async def retrieve_future(body: RetrieveFutureRequest, request: Request, who: CallerDep) -> Response:
    waiters = request.app.state.waiters
    settings = request.app.state.settings
    waiter = waiters.register(body.request_id)  # before reading, so a result written meanwhile is not missed
    try:
        future = await asyncio.to_thread(_load, request, body.request_id, who)
        if future is None:  # another key's request is "not found" too
            raise NotFoundError(f"retrieve_future: request {body.request_id!r} not found")
        # Woken by the engine's notification at once; the database is re-read every `recheck` seconds as
        # well, for an engine that cannot notify this process (--engine external, or one that just died).
        recheck = EXTERNAL_RECHECK_S if settings.engine == "external" else RECHECK_S
        deadline = asyncio.get_running_loop().time() + settings.long_poll_s
        while future.status in (FutureStatus.PENDING.value, FutureStatus.RUNNING.value):
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                answer = {"type": "try_again", "request_id": body.request_id, "queue_state": "active"}
                reason = await asyncio.to_thread(_waiting_reason, request, body.request_id)
                if reason:  # the SDK logs "<call> for <id> is paused. Reason: ..." for a non-active state only
                    answer.update(queue_state="paused_capacity", queue_state_reason=reason)
                return JSONResponse(answer)
            try:
                await asyncio.wait_for(waiter.event.wait(), timeout=min(recheck, remaining))
            except TimeoutError:
                pass
            waiter.event.clear()
            # Woken by the engine: it handed over what it stored. A recheck reads the database.
            future = waiter.outcome
            if future is None or future.result is RESULT_IN_DATABASE:  # a recheck, or a result left out of the wake-up
                rechecked = future is None
                future = await asyncio.to_thread(_load, request, body.request_id)
                if rechecked and settings.engine != "external" and future is not None and future.status not in (
                        FutureStatus.PENDING.value, FutureStatus.RUNNING.value):
                    request.app.state.metrics.long_poll_missed_wakeups.inc()  # finished, and nobody woke this poll
        ring = ring_of(request.app)
        if ring is not None:  # phase times (api/trace/ring.py): this poll saw it finished; answered once sent
            ring.woken(body.request_id)
            request.state.answered_future = body.request_id
        return _render(future, request.headers.get("accept", ""))
    finally:
        waiters.unregister(body.request_id, waiter)


def _cancel(request: Request, future_id: str, who: Principal) -> tuple[dict[str, Any], FutureOutcome | None]:
    """The answer, and the outcome to wake the future's pollers with where it was cancelled. The status change is
    one conditional UPDATE (pending -> failed), as is the engine's claim (pending -> running): exactly one wins."""
    with request.app.state.database.begin() as db:
        row = db.execute(OWNED_REQUEST, {"id_": future_id}).one_or_none()
        if row is None or not who.sees(row.owner_key_id):  # another key's request is "not found" too
            raise NotFoundError(f"cancel_future: request {future_id!r} not found")
        if row.request_type in UNCANCELLABLE:
            raise ConflictError(f"cancel_future: request {future_id!r} is a {row.request_type} request, which "
                                "cannot be cancelled (training, save, load and sample requests can)")
        message = f"request {future_id} was cancelled (cancel_future) before it ran; it did not run"
        if row.model_id is not None and row.seq_id is not None:  # the engine counts it done: nothing waits for it
            message += f"; its seq_id {row.seq_id} is used up, and the model's later requests run without it"
        error = {"category": "user", "code": "cancelled", "message": message}
        params = {"id_": future_id, "error_": error, "now": datetime.now(timezone.utc)}
        if db.execute(future_queries.CANCEL_PENDING, params).rowcount == 1:
            answer = {"request_id": future_id, "cancelled": True, "status": FutureStatus.FAILED.value,
                      "message": message}
            return answer, FutureOutcome(future_id, FutureStatus.FAILED.value, row.request_type, None, error)
        status = db.execute(future_queries.FUTURE_STATUS, {"id_": future_id}).scalar_one()
    if status == FutureStatus.RUNNING.value:
        message = f"request {future_id} is already running: it was not cancelled and finishes as usual"
    else:
        message = f"request {future_id} has already finished ({status}): there is nothing to cancel"
    return {"request_id": future_id, "cancelled": False, "status": status, "message": message}, None


@router.post("/cancel_future", responses={**BODY_ERRORS, **errors(404, 409)})
async def cancel_future(body: CancelFutureRequest, request: Request, who: CallerDep) -> CancelFutureResponse:
    """SDK 0.38 sends this for a sample it stopped waiting for (when the dynamic config sets sample_cancel_enabled).
    A request still pending fails with a "cancelled" user error and never runs; one running or done is left be."""
    answer, outcome = await asyncio.to_thread(_cancel, request, body.request_id, who)
    if outcome is not None:
        request.app.state.waiters.deliver([outcome])  # its retrieve_future / retrieve_futures polls answer at once
        request.app.state.wake_engine()  # a model's later requests may have waited for this seq_id
    return CancelFutureResponse.model_validate(answer)
