"""What /openapi.json says the OpenAI-compatible routes take and answer (the routes build their JSON themselves,
api/openai/render.py): request bodies, completions, model lists, the streamed media type, OpenAI-shaped errors."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from skyrl_tx.api.openai.schemas import ChatBody, CompletionBody
from skyrl_tx.api.responses import errors

FiniteFloat = float | Literal["NaN", "Infinity", "-Infinity"]


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIErrorBody(BaseModel):
    error: OpenAIErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    stop_reason: str | None
    logprobs: dict[str, Any] | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str | None
    choices: list[CompletionChoice]
    usage: Usage


class ChatMessage(BaseModel):
    role: Literal["assistant"]
    content: str
    refusal: str | None
    tool_calls: list[dict[str, Any]]


class ChatChoice(BaseModel):
    index: int
    finish_reason: str | None
    message: ChatMessage
    logprobs: dict[str, Any] | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str | None
    choices: list[ChatChoice]
    usage: Usage


class ModelEntry(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelEntry]


_STATUS_TEXT = {400: "Invalid request: `param` names the field", 404: "No such model (or sampling session)",
                409: "Conflict", 410: "The sampling session has ended", 429: "The API key's quota is used up",
                500: "Internal error", 501: "This server cannot tokenize text (send token ids)",
                503: "The engine cannot serve this now"}


def _openai_errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": OpenAIErrorBody, "description": _STATUS_TEXT[status]} for status in statuses}


# 401 and 413 come from the middlewares in front of every route, in the Tinker error shape.
_SAMPLING_ERRORS = {**errors(401, 413), **_openai_errors(400, 404, 409, 410, 429, 500, 501, 503)}
_SSE = {"text/event-stream": {"schema": {"type": "string", "description": "`data: {chunk}` events (stream: true), "
                                                                          "then `data: [DONE]`"}}}


def _body(model: type[BaseModel]) -> dict[str, Any]:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}


COMPLETIONS = {"openapi_extra": _body(CompletionBody), "responses": {
    **_SAMPLING_ERRORS, 200: {"model": Completion, "description": "The completion, or its chunks (stream: true)",
                              "content": _SSE}}}
CHAT_COMPLETIONS = {"openapi_extra": _body(ChatBody), "responses": {
    **_SAMPLING_ERRORS, 200: {"model": ChatCompletion, "description": "The chat completion, or its chunks "
                                                                      "(stream: true)", "content": _SSE}}}
MODELS = {"responses": {**errors(401), **_openai_errors(500), 200: {"model": ModelList, "description": "The models"}}}
MODEL = {"openapi_extra": {"parameters": [{"name": "model", "in": "path", "required": True, "schema": {
    "type": "string"}, "description": "a served model name, or a sampler checkpoint's whole tinker:// path"}]},
    "responses": {**errors(401), **_openai_errors(404, 500), 200: {"model": ModelEntry,
                                                                         "description": "The model"}}}
