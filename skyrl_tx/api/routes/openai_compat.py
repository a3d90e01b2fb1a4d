"""The OpenAI-compatible endpoint (/oai/api/v1, alias /v1): completions, chat completions and models, sampled by
the same engine batch as Tinker's asample. Errors are OpenAI-shaped ({"error": {message, type, param, code}}).

`stream: true` sends server-sent-event chunks as the engine decodes (api/openai/live.py: the engine reports each
streaming sample's new tokens after every decode step); with `logprobs` it sends the finished result as chunks, one
per generated token (the decode steps report tokens, not logprobs)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from skyrl_tx.api.json_response import FiniteJSONResponse
from skyrl_tx.api.openai import render
from skyrl_tx.api.openai import responses as documented
from skyrl_tx.api.openai.errors import PREFIXES, OpenAIError, error_json, from_skyrl, invalid
from skyrl_tx.api.openai.live import live_sse
from skyrl_tx.api.openai.sampling import resolve_weights, sample, sampler_checkpoints
from skyrl_tx.api.openai.schemas import (ChatBody, CompletionBody, chat_messages, chat_spec, completion_spec, parse,
                                         prompts_of)
from skyrl_tx.api.openai.text import ModelText
from skyrl_tx.api.principal import caller
from skyrl_tx.errors import SkyrlTxError

router = APIRouter()


@cache
def _model_text(model_dir: str) -> ModelText:
    return ModelText(Path(model_dir))


async def model_text(request: Request) -> ModelText:
    """The base model's tokenizer and chat template (loaded on first use, in a thread: tokenizer.json is MBs)."""
    try:
        return await asyncio.to_thread(_model_text, str(request.app.state.model_dir))
    except FileNotFoundError as exc:
        raise OpenAIError(501, f"this server cannot turn text into tokens: {exc}; send token ids to /completions",
                          None) from None


async def _body(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise invalid(f"the request body is not valid JSON ({exc})") from None


def _openai_errors(route: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """Every refusal of these routes in OpenAI's error shape (the app's own handlers write Tinker's)."""
    async def wrapped(request: Request) -> Response:
        try:
            return await route(request)
        except OpenAIError as exc:
            return error_json(exc)
        except SkyrlTxError as exc:
            return error_json(from_skyrl(exc))
    return wrapped


def _check_n(request: Request, n: int) -> None:
    backend = request.app.state.settings.backend
    most = backend.max_sampling_sequences
    if n > most and not backend.gpu_memory_utilization:  # else the engine knows its rows, and checks n itself
        raise invalid(f"n must be at most {most} here (max_sampling_sequences in --backend-config; got {n})", "n")


def _max_tokens(request: Request, asked: int | None, asked_name: str, prompt_length: int, prompt_name: str) -> int:
    """max_tokens as asked, or (chat without a limit) what is left of the sampling length after the prompt."""
    room = min(request.app.state.settings.backend.max_sampling_length, request.app.state.max_positions)
    if prompt_length >= room:
        raise invalid(f"the prompt has {prompt_length} tokens; this server samples at most {room} tokens of "
                      "prompt + completion (max_sampling_length); shorten it", prompt_name)
    if asked is not None and prompt_length + asked > room:
        raise invalid(f"the prompt ({prompt_length} tokens) + {asked_name} ({asked}) exceeds the {room} tokens of "
                      f"prompt + completion this server samples (max_sampling_length); lower {asked_name}",
                      asked_name)
    return room - prompt_length if asked is None else asked


async def _respond(spec: Any, chunks: Callable[[], Iterator[dict[str, Any]]],
                   whole: Callable[[], dict[str, Any]]) -> Response:
    """The answer, built off the event loop (detokenizing is CPU work): a streamed body is iterated in Starlette's
    thread pool, a whole one is built in a thread."""
    if spec.stream:
        return StreamingResponse(render.sse(chunks()), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return FiniteJSONResponse(await asyncio.to_thread(whole))


def _live(events: Any) -> Response:
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _tokenize_prompts(text: ModelText, raw_prompts: list[str | list[int]]) -> list[list[int]]:
    prompts = []
    for p in raw_prompts:
        tokens = text.encode(p) if isinstance(p, str) else list(p)
        if not tokens:
            raise invalid("a prompt must hold at least one token", "prompt")
        text.check_tokens(tokens, "prompt")
        prompts.append(tokens)
    return prompts


def _chat_prompt(text: ModelText, body: ChatBody) -> list[int]:
    rendered = text.render_chat(chat_messages(body), body.add_generation_prompt, dict(body.chat_template_kwargs or {}))
    prompt = text.encode_chat(rendered)
    if not prompt:
        raise invalid("the chat template rendered these messages as no tokens", "messages")
    return prompt


@_openai_errors
async def completions(request: Request) -> Response:
    body = parse(CompletionBody, await _body(request))
    spec = completion_spec(body)
    _check_n(request, spec.n)
    raw_prompts = prompts_of(body)
    text = await model_text(request)
    prompts = await asyncio.to_thread(_tokenize_prompts, text, raw_prompts)
    who = await caller(request)
    weights_id = await asyncio.to_thread(resolve_weights, request, body.model, who)
    limits = [_max_tokens(request, spec.params["max_tokens"], "max_tokens", len(p), "prompt") for p in prompts]
    if spec.stream and not spec.logprobs:  # chunk by chunk as the engine decodes (api/openai/live.py)
        return _live(live_sse(request, who, spec, weights_id, text, body.model, prompts, limits, chat=False))
    results = await sample(request, who, spec, weights_id, prompts, limits)
    picked = await asyncio.to_thread(render.choices, text, spec, results)
    lengths = [len(p) for p in prompts]
    return await _respond(spec, lambda: render.completion_chunks(text, spec, body.model, picked, lengths),
                          lambda: render.completion(text, spec, body.model, picked, lengths))


@_openai_errors
async def chat_completions(request: Request) -> Response:
    body = parse(ChatBody, await _body(request))
    spec = chat_spec(body)
    _check_n(request, spec.n)
    text = await model_text(request)
    prompt = await asyncio.to_thread(_chat_prompt, text, body)
    who = await caller(request)
    weights_id = await asyncio.to_thread(resolve_weights, request, body.model, who)
    limit = _max_tokens(request, spec.params["max_tokens"], spec.max_tokens_name, len(prompt), "messages")
    if spec.stream and not spec.logprobs:
        return _live(live_sse(request, who, spec, weights_id, text, body.model, [prompt], [limit], chat=True))
    (result,) = await sample(request, who, spec, weights_id, [prompt], [limit])
    picked = await asyncio.to_thread(render.choices, text, spec, [result])
    return await _respond(spec, lambda: render.chat_chunks(text, spec, body.model, picked, len(prompt)),
                          lambda: render.chat_completion(text, spec, body.model, picked, len(prompt)))


async def _model_list(request: Request) -> list[dict[str, Any]]:
    """The served base model (and its aliases), then every ready sampler checkpoint by its tinker:// path."""
    settings = request.app.state.settings
    created = int(time.time())
    data = [{"id": name, "object": "model", "created": created, "owned_by": "skyrl_tx", "root": settings.base_model,
             "parent": None} for name in settings.served_names()]
    for path, base, when in await asyncio.to_thread(sampler_checkpoints, request, await caller(request)):
        data.append({"id": path, "object": "model", "created": int(when), "owned_by": "skyrl_tx", "root": base,
                     "parent": base})
    return data


@_openai_errors
async def models(request: Request) -> Response:
    return FiniteJSONResponse({"object": "list", "data": await _model_list(request)})


@_openai_errors
async def model(request: Request) -> Response:
    """GET /models/{model}: one of the list (a tinker:// path given whole, slashes included)."""
    name = request.path_params["model"]
    found = next((m for m in await _model_list(request) if m["id"] == name), None)
    if found is None:
        raise OpenAIError(404, f"The model `{name}` does not exist on this server", "model")
    return FiniteJSONResponse(found)


for _prefix in PREFIXES:
    # The routes parse their own bodies (for OpenAI-shaped errors); openai/responses.py says what they take and answer.
    router.add_api_route(f"{_prefix}/completions", completions, methods=["POST"], response_model=None,
                         **documented.COMPLETIONS)
    router.add_api_route(f"{_prefix}/chat/completions", chat_completions, methods=["POST"], response_model=None,
                         **documented.CHAT_COMPLETIONS)
    router.add_api_route(f"{_prefix}/models", models, methods=["GET"], response_model=None, **documented.MODELS)
    router.add_api_route(f"{_prefix}/models/{{model:path}}", model, methods=["GET"], response_model=None,
                         **documented.MODEL)
