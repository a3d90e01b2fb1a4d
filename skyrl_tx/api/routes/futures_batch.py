"""retrieve_futures: SDK 0.38's long poll of a sampling session's completion queue (many samples, one cursor).

The SDK runs one such poll per (sampling session, cloned sampler) when the client config sets
`sample_use_retrieve_futures`; a sample's future waits for its completion to be reported here, then fetches the
result with retrieve_future as before. Completions are numbered and read in db/completion_queues.py."""

from __future__ import annotations

import asyncio
from typing import Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from skyrl_tx.api.ownership import owned_sampler
from skyrl_tx.api.principal import CallerDep, Principal
from skyrl_tx.api.responses import BODY_ERRORS, FutureCompletion, FuturesRetrieveResponse, errors
from skyrl_tx.api.routes.futures import EXTERNAL_RECHECK_S, RECHECK_S
from skyrl_tx.api.trace.ring import ring_of
from skyrl_tx.api.validation import INT64_MAX, check_finite, check_int_range
from skyrl_tx.db.completion_queues import CLONE_SEQ_BLOCK, Completion, completions_since, queue_name
from skyrl_tx.db.models import FutureStatus
from skyrl_tx.errors import InvalidArgumentError

router = APIRouter(prefix="/api/v1")
WHAT = "retrieve_futures"
MAX_COMPLETIONS_PER_POLL = 1000  # more are answered by the next poll, which the SDK sends at once
# The SDK reports the requests whose results it fetched since its last poll: a few per poll in practice; the bound
# only keeps one body from holding the server up.
MAX_RETRIEVED_IDS = 100_000


class SamplingSessionTarget(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["sampling_session"] = "sampling_session"
    sampling_session_id: str
    cloned_sampler_id: int = 0


class RetrieveFuturesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    target: SamplingSessionTarget
    prev_cursor: int = 0
    timeout: float | None = None  # seconds; None: the server's long poll (--long-poll-s); 0: answer at once
    # What the SDK fetched since its last poll, "so the server may delete their payloads": taken and not acted on,
    # results stay until the retention sweep (engine/retention.py), as without this poll.
    retrieved_request_ids: list[str] = Field(default_factory=list)


def _check(body: RetrieveFuturesRequest) -> None:
    check_int_range(body.prev_cursor, "prev_cursor", 0, INT64_MAX, WHAT)
    check_int_range(body.target.cloned_sampler_id, "target.cloned_sampler_id", 0, INT64_MAX // CLONE_SEQ_BLOCK, WHAT)
    if body.timeout is not None and check_finite(body.timeout, "timeout", WHAT) < 0:
        raise InvalidArgumentError(f"{WHAT}: timeout must be 0 or more seconds (got {body.timeout!r})")
    if len(body.retrieved_request_ids) > MAX_RETRIEVED_IDS:
        raise InvalidArgumentError(f"{WHAT}: retrieved_request_ids holds {len(body.retrieved_request_ids)} ids, at "
                                   f"most {MAX_RETRIEVED_IDS} are taken per call; report the rest on the next poll")


def _render(completions: list[Completion]) -> list[FutureCompletion]:
    # No response_payload_uncompressed_size: the SDK then fetches the result as it does without this poll.
    return [FutureCompletion(state="failed" if c.status == FutureStatus.FAILED.value else "finished",
                             request_id=c.request_id) for c in completions]


def _first_read(request: Request, body: RetrieveFuturesRequest, queue: str,
                who: Principal) -> tuple[list[Completion], int]:
    """Another key's sampling session is "not found", as everywhere; then the queue's completions so far."""
    database = request.app.state.database
    with database.connect() as db:
        owned_sampler(db, body.target.sampling_session_id, who, f"{WHAT}: sampling session "
                      f"{body.target.sampling_session_id!r} not found")
    return completions_since(database, queue, body.prev_cursor, MAX_COMPLETIONS_PER_POLL)


@router.post("/retrieve_futures", responses={**BODY_ERRORS, **errors(404)})
async def retrieve_futures(body: RetrieveFuturesRequest, request: Request,
                           who: CallerDep) -> FuturesRetrieveResponse:
    _check(body)
    settings = request.app.state.settings
    database = request.app.state.database
    waiters = request.app.state.waiters
    wait_s = settings.long_poll_s if body.timeout is None else min(body.timeout, settings.long_poll_s)
    queue = queue_name(body.target.sampling_session_id, body.target.cloned_sampler_id)
    waiter = waiters.register_queue(queue)  # before reading, so a sample finishing meanwhile is not missed
    try:
        completions, cursor = await asyncio.to_thread(_first_read, request, body, queue, who)
        # Woken by the engine's notification (or cancel_future) when a sample of the queue finishes; the database
        # is re-read every `recheck` seconds as well, for an engine that cannot notify this process.
        recheck = EXTERNAL_RECHECK_S if settings.engine == "external" else RECHECK_S
        deadline = asyncio.get_running_loop().time() + wait_s
        while not completions:
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                break
            try:
                await asyncio.wait_for(waiter.event.wait(), timeout=min(recheck, remaining))
            except TimeoutError:
                pass
            waiter.event.clear()
            completions, cursor = await asyncio.to_thread(completions_since, database, queue, body.prev_cursor,
                                                          MAX_COMPLETIONS_PER_POLL)
        ring = ring_of(request.app)
        if ring is not None:  # phase times (api/trace/ring.py): the first poll that saw each sample finished
            for c in completions:
                ring.woken(c.request_id)
        return FuturesRetrieveResponse(completions=_render(completions), cursor=cursor)
    finally:
        waiters.unregister_queue(queue, waiter)
