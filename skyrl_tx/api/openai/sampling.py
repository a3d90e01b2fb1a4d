"""The engine side of an OpenAI request: its model resolved to weights, its prompts submitted as the same `sample`
futures the Tinker SDK's asample creates (one continuous batch for both), and their results awaited."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from sqlalchemy import select

from skyrl_tx.api.openai.errors import OpenAIError, from_future_error, from_skyrl
from skyrl_tx.api.openai.schemas import SamplingSpec
from skyrl_tx.api.ownership import check_inflight, readable_checkpoint
from skyrl_tx.api.principal import Principal
from skyrl_tx.api.submit import submit_future
from skyrl_tx.checkpoints.formats import ModelMeta
from skyrl_tx.checkpoints.paths import TinkerPath
from skyrl_tx.db import future_queries
from skyrl_tx.db.future_queries import RESULT_IN_DATABASE
from skyrl_tx.db.models import CheckpointKind, CheckpointRecord, CheckpointStatus, FutureStatus, ModelRecord
from skyrl_tx.errors import SkyrlTxError

RECHECK_S = 1.0  # safety net only: results normally arrive by notification (as in retrieve_future)
EXTERNAL_RECHECK_S = 0.05  # an external engine cannot notify this process


def _not_found(model: str) -> OpenAIError:
    return OpenAIError(404, f"The model `{model}` does not exist on this server: name a base model it serves "
                            "(GET /models) or a tinker://…/sampler_weights/… checkpoint path", "model")


def resolve_weights(request: Request, model: str, who: Principal) -> str:
    """The engine's weights id for `model`: "" for the base model (or an alias), the tinker:// path of a ready
    sampler checkpoint `who` may read (its own or a published one: another key's is "not found"); the engine loads
    it as create_sampling_session(model_path=…) does. Runs in a thread."""
    settings = request.app.state.settings
    if settings.serves(model):
        return ""
    if not model.startswith("tinker://"):
        raise _not_found(model)
    try:
        path = TinkerPath.parse(model, "model")
    except SkyrlTxError as exc:
        raise from_skyrl(exc, "model") from None
    if path.kind != CheckpointKind.SAMPLER_WEIGHTS.value:
        raise OpenAIError(400, f"{model} is a {path.checkpoint_type} checkpoint; sample from sampler weights "
                               "(tinker://…/sampler_weights/…, written by save_weights_for_sampler)", "model")
    with request.app.state.session_factory() as db:
        try:
            record = readable_checkpoint(db, path, who, "model")
        except SkyrlTxError:
            raise _not_found(model) from None
        if not settings.serves(ModelMeta.from_json(record.model_meta).base_model):
            raise _not_found(model)
    return str(path)


def sampler_checkpoints(request: Request, who: Principal) -> list[tuple[str, str, float]]:
    """(tinker path, base model, created unix time) of every ready sampler checkpoint `who` may read: its own
    (through their models) and published ones, as readable_checkpoint decides for one. Runs in a thread."""
    query = (select(CheckpointRecord.tinker_path, CheckpointRecord.model_meta, CheckpointRecord.created_at,
                    CheckpointRecord.public, ModelRecord.owner_key_id)
             .join(ModelRecord, ModelRecord.id == CheckpointRecord.model_id)
             .where(CheckpointRecord.kind == CheckpointKind.SAMPLER_WEIGHTS.value,
                    CheckpointRecord.status == CheckpointStatus.READY.value)
             .order_by(CheckpointRecord.created_at))
    with request.app.state.session_factory() as db:
        rows = db.execute(query).all()
    base = request.app.state.settings.base_model
    return [(path, ModelMeta.from_json(meta).base_model if meta else base, created.timestamp())
            for path, meta, created, public, owner in rows if public or who.sees(owner)]


def _submit_all(request: Request, jobs: list[tuple[str, dict[str, Any]]], who: Principal) -> None:
    with request.app.state.database.connect() as db:
        check_inflight(db, who)  # the key's quota counts its Tinker requests (these futures have no owner row)
        for future_id, job in jobs:
            submit_future(request, db, future_id=future_id, request_type="sample", body=job)


def _load(request: Request, future_id: str) -> Any:
    with request.app.state.database.connect() as db:
        return db.execute(future_queries.OUTCOME, {"id_": future_id}).one_or_none()


async def sample(request: Request, who: Principal, spec: SamplingSpec, weights_id: str,
                 prompts: list[list[int]], max_tokens: list[int]) -> list[dict[str, Any]]:
    """The engine's sample results ({"sequences": [{tokens, logprobs, stop_reason}]}), one per prompt, each from
    a `sample` future of num_samples = n (what asample stores). Waits on the engine's notification."""
    async for event in stream_sample(request, who, spec, weights_id, prompts, max_tokens, stream=False):
        if event[0] == "results":
            return event[1]
    raise AssertionError("stream_sample ended without results")


async def stream_sample(request: Request, who: Principal, spec: SamplingSpec, weights_id: str,
                        prompts: list[list[int]], max_tokens: list[int],
                        stream: bool = True) -> AsyncIterator[tuple[str, Any]]:
    """One `sample` future per prompt (num_samples = n, what asample stores). With `stream`, yields ("tokens", prompt
    index, [new tokens per sample]) after every decode step that added some (engine/loop.py reports them); then
    ("results", the engine's results, one per prompt). Waits on the engine's notifications."""
    if request.app.state.engine_failed:
        raise OpenAIError(503, request.app.state.engine_failed)
    waiters = request.app.state.waiters
    jobs = [(f"oai-{uuid.uuid4().hex}", {"weights_id": weights_id, "prompt_tokens": prompt, "num_samples": spec.n,
                                          "sampling_params": {**spec.params, "max_tokens": limit},
                                          "prompt_logprobs": False, "topk_prompt_logprobs": 0,
                                          **({"topk_sample_logprobs": spec.top_logprobs} if spec.top_logprobs else {}),
                                          **({"stream": True} if stream else {})})
            for prompt, limit in zip(prompts, max_tokens)]
    registered = [(future_id, waiters.register(future_id)) for future_id, _ in jobs]  # before the engine can finish
    recheck = EXTERNAL_RECHECK_S if request.app.state.settings.engine == "external" else RECHECK_S
    try:
        await asyncio.to_thread(_submit_all, request, jobs, who)
        results: list[Any] = [None] * len(jobs)
        pending = set(range(len(jobs)))
        while pending:
            waits = {asyncio.ensure_future(registered[i][1].event.wait()) for i in pending}
            done, rest = await asyncio.wait(waits, timeout=recheck, return_when=asyncio.FIRST_COMPLETED)
            for task in rest:
                task.cancel()
            for i in sorted(pending):
                future_id, waiter = registered[i]
                waiter.event.clear()
                while waiter.progress:
                    yield "tokens", i, waiter.progress.pop(0)
                outcome = waiter.outcome
                if outcome is None and not done or outcome is not None and outcome.result is RESULT_IN_DATABASE:
                    outcome = await asyncio.to_thread(_load, request, future_id)  # a recheck: the database
                if outcome is None or outcome.status in (FutureStatus.PENDING.value, FutureStatus.RUNNING.value):
                    continue
                if outcome.status == FutureStatus.FAILED.value:
                    raise from_future_error(outcome.error)
                results[i] = outcome.result
                pending.discard(i)
        yield "results", results
    finally:
        for future_id, waiter in registered:
            waiters.unregister(future_id, waiter)
