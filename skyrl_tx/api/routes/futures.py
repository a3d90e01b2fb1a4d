"""retrieve_future: long-polls a future; results as protobuf where the SDK asks for it, else JSON."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request, Response
from skyrl_tx.api.json_response import FiniteJSONResponse as JSONResponse  # results may hold NaN
from pydantic import BaseModel, ConfigDict
from sqlalchemy import Row

from skyrl_tx.db import future_queries
from skyrl_tx.db.future_queries import FutureOutcome
from skyrl_tx.db.models import FutureStatus
from skyrl_tx.errors import NotFoundError
from skyrl_tx.wire.codec import encode_forward_backward_output, encode_sample_response

router = APIRouter(prefix="/api/v1")
PROTOBUF = "application/x-protobuf"
RECHECK_S = 1.0  # safety net only: results normally arrive by notification
EXTERNAL_RECHECK_S = 0.05  # an external engine cannot notify this process: the database is the only signal


class RetrieveFutureRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    request_id: str
    allow_metadata_only: bool = False


def _load(request: Request, future_id: str) -> Row | None:
    """The future's status, request_type, result and error (never its stored request body)."""
    with request.app.state.database.connect() as db:
        return db.execute(future_queries.OUTCOME, {"id_": future_id}).one_or_none()


def _render(future: Row | FutureOutcome, accept: str) -> Response:
    if future.status == FutureStatus.FAILED.value:
        error = future.error or {}
        return JSONResponse({"error": error.get("message", "request failed"), "category": error.get("category", "server")})
    result: Any = future.result
    wants_proto = PROTOBUF in accept
    if future.request_type in ("forward", "forward_backward"):
        if wants_proto:
            body = encode_forward_backward_output(result["loss_fn_outputs"], result["metrics"])
            return Response(body, media_type=PROTOBUF)
        outputs = [{k: {"data": v, "dtype": "float32", "shape": [len(v)]} for k, v in out.items()}
                   for out in result["loss_fn_outputs"]]
        return JSONResponse({"loss_fn_output_type": "ArrayRecord", "loss_fn_outputs": outputs,
                             "metrics": result["metrics"]})
    if future.request_type == "sample" and wants_proto:
        body = encode_sample_response(result["sequences"], result.get("prompt_logprobs"),
                                      result.get("topk_prompt_logprobs"))
        return Response(body, media_type=PROTOBUF)
    return JSONResponse(result)


@router.post("/retrieve_future")
async def retrieve_future(body: RetrieveFutureRequest, request: Request) -> Response:
    waiters = request.app.state.waiters
    settings = request.app.state.settings
    waiter = waiters.register(body.request_id)  # before reading, so a result written meanwhile is not missed
    try:
        future = await asyncio.to_thread(_load, request, body.request_id)
        if future is None:
            raise NotFoundError(f"retrieve_future: request {body.request_id!r} not found")
        # Woken by the engine's notification at once; the database is re-read every `recheck` seconds as
        # well, for an engine that cannot notify this process (--engine external, or one that just died).
        recheck = EXTERNAL_RECHECK_S if settings.engine == "external" else RECHECK_S
        deadline = asyncio.get_running_loop().time() + settings.long_poll_s
        while future.status in (FutureStatus.PENDING.value, FutureStatus.RUNNING.value):
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return JSONResponse({"type": "try_again", "request_id": body.request_id, "queue_state": "active"})
            try:
                await asyncio.wait_for(waiter.event.wait(), timeout=min(recheck, remaining))
            except TimeoutError:
                pass
            waiter.event.clear()
            # Woken by the engine: it handed over what it stored. A recheck reads the database.
            future = waiter.outcome or await asyncio.to_thread(_load, request, body.request_id)
        return _render(future, request.headers.get("accept", ""))
    finally:
        waiters.unregister(body.request_id, waiter)
