"""Request bodies of the OpenAI-compatible endpoint: parsed and checked into one SamplingSpec, every refusal a 400
naming its field (unknown fields, and known OpenAI fields this server cannot honour, are refused, never dropped)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from skyrl_tx.api.openai.errors import invalid, unsupported
from skyrl_tx.api.validation import INT64_MAX

MAX_N = 128  # choices per prompt: each is a sequence of the engine's continuous batch


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow", strict=False)
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # an extra field (vLLM's): -1 or 0 = off
    n: int | None = None
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    stop_token_ids: list[int] | None = None  # an extra field (vLLM's)
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None


class CompletionBody(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None


class ChatBody(_Common):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    add_generation_prompt: bool = True  # extra fields (vLLM's): how the chat template is rendered
    chat_template_kwargs: dict[str, Any] | None = None


def _is_default(value: Any, defaults: tuple[Any, ...]) -> bool:
    return any(value == d and type(value) is type(d) or value is d for d in defaults)


# OpenAI fields accepted at their no-op values only (clients often send them so): any other value is refused.
_NOOP_VALUES: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0, 0.0, None), "presence_penalty": (0, 0.0, None), "logit_bias": (None, {}),
    "echo": (False, None), "suffix": (None, ""), "tools": (None, []), "tool_choice": (None, "none"),
    "parallel_tool_calls": (None, True, False), "response_format": (None, {"type": "text"}),
    "store": (None, False), "service_tier": (None, "auto", "default"), "metadata": (None, {}),
    "functions": (None, []), "function_call": (None, "none"),
}
_FREE_FIELDS = {"user"}  # no effect on sampling: accepted with any value
_SHAPES = {"stop": "a string, a list of strings, or a list of token ids",
           "prompt": "a string, a list of strings, a list of token ids, or a list of token id lists",
           "messages": "a list of message objects ({\"role\": ..., \"content\": ...})"}


@dataclass
class SamplingSpec:
    """What one OpenAI request asks of the engine (per prompt: one sampling future of num_samples=n)."""

    model: str
    n: int
    params: dict[str, Any]  # the Tinker sampling_params (max_tokens None: chosen from the prompt's length)
    stop_strings: list[str] = field(default_factory=list)
    stop_ids: set[int] = field(default_factory=set)
    logprobs: bool = False
    stream: bool = False
    include_usage: bool = False
    max_tokens_name: str = "max_tokens"  # the field the limit came from (chat: max_completion_tokens too)
    top_logprobs: int = 0  # alternatives per generated token (the engine's topk_sample_logprobs)


def parse(kind: type[BaseModel], raw: Any) -> Any:
    if not isinstance(raw, dict):
        raise invalid("the request body must be a JSON object")
    try:
        body = kind.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        name = str(first["loc"][0]) if first.get("loc") else None
        if name in _SHAPES:
            raise invalid(f"{name} must be {_SHAPES[name]}", name) from None
        raise invalid(f"{name or 'body'}: {first.get('msg')}", name) from None
    for name, value in (body.model_extra or {}).items():
        if name in _FREE_FIELDS:
            continue
        if name in _NOOP_VALUES:
            if not _is_default(value, _NOOP_VALUES[name]):
                raise unsupported(name, f"only {_NOOP_VALUES[name][0]!r} (no effect) is accepted")
            continue
        if name == "best_of" and value in (None, 1, raw.get("n") or 1):
            continue
        raise unsupported(name)
    return body


def _number(value: float | None, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    if value is None:
        return default
    if not math.isfinite(value) or value < low or value > high or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise invalid(f"{name} must be in {bracket}{low:g}, {high:g}] (got {value!r})", name)
    return float(value)


def _int(value: int | None, name: str, low: int, high: int) -> int | None:
    if value is not None and not low <= value <= high:
        raise invalid(f"{name} must be an integer in [{low}, {high}] (got {value!r})", name)
    return value


def sampling_spec(body: _Common, max_tokens: int | None, max_tokens_name: str, logprobs: bool) -> SamplingSpec:
    """The Tinker sampling parameters of a parsed body (the fields common to both endpoints)."""
    _int(max_tokens, max_tokens_name, 1, INT64_MAX)
    top_k = _int(body.top_k, "top_k", -1, INT64_MAX)
    n = _int(body.n, "n", 1, MAX_N) or 1
    seed = _int(body.seed, "seed", 0, INT64_MAX)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    strings = [s for s in stop if isinstance(s, str)]
    ids = [s for s in stop if not isinstance(s, str)] + list(body.stop_token_ids or [])
    if any(s == "" for s in strings):
        raise invalid("stop strings must be non-empty", "stop")
    if strings and ids:
        raise invalid("this server stops on strings or on token ids within one request, not both: send stop "
                      "strings, or token ids (stop / stop_token_ids)",
                      "stop_token_ids" if body.stop_token_ids else "stop")
    for token in ids:
        _int(token, "stop", 0, INT64_MAX)
    include_usage = False
    if body.stream_options is not None:
        if not body.stream:
            raise invalid("stream_options is only allowed with stream: true", "stream_options")
        unknown = set(body.stream_options) - {"include_usage"}
        if unknown:
            raise unsupported(f"stream_options.{min(unknown)}")
        include_usage = bool(body.stream_options.get("include_usage"))
    params = {"max_tokens": max_tokens,
              "temperature": _number(body.temperature, "temperature", 1.0, 0.0, 1e6),
              "top_p": _number(body.top_p, "top_p", 1.0, 0.0, 1.0, low_open=True),
              "top_k": -1 if top_k in (None, 0) else top_k, "seed": seed,
              # OpenAI's stop adds to EOS; Tinker's stop=[] would turn EOS off: no stops is None here
              "stop": (strings or ids) or None}
    return SamplingSpec(body.model, n, params, strings, set(ids), logprobs, bool(body.stream), include_usage,
                        max_tokens_name)


# OpenAI's own bounds: chat's top_logprobs at most 20, legacy completions' logprobs at most 5.
MAX_CHAT_TOP_LOGPROBS, MAX_COMPLETION_LOGPROBS = 20, 5


def completion_spec(body: CompletionBody) -> SamplingSpec:
    _int(body.logprobs, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    spec = sampling_spec(body, 16 if body.max_tokens is None else body.max_tokens, "max_tokens",
                         body.logprobs is not None)
    spec.top_logprobs = body.logprobs or 0
    return spec


def chat_spec(body: ChatBody) -> SamplingSpec:
    _int(body.top_logprobs, "top_logprobs", 0, MAX_CHAT_TOP_LOGPROBS)
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
    if body.max_tokens is not None and body.max_completion_tokens is not None \
            and body.max_tokens != body.max_completion_tokens:
        raise invalid("max_tokens and max_completion_tokens disagree; send one", "max_completion_tokens")
    name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    spec = sampling_spec(body, limit, name, bool(body.logprobs))
    spec.top_logprobs = body.top_logprobs or 0
    return spec


def chat_messages(body: ChatBody) -> list[dict[str, Any]]:
    """The messages as the chat template takes them: text content parts joined into one string."""
    if not body.messages:
        raise invalid("messages must hold at least one message", "messages")
    out = []
    for i, message in enumerate(body.messages):
        if not isinstance(message.get("role"), str):
            raise invalid(f"messages[{i}] has no role", "messages")
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise invalid(f"messages[{i}].content: only text parts are supported (got "
                                  f"{part.get('type') if isinstance(part, dict) else part!r})", "messages")
                parts.append(part["text"])
            message = {**message, "content": "".join(parts)}
        elif content is not None and not isinstance(content, str):
            raise invalid(f"messages[{i}].content must be a string or a list of text parts", "messages")
        out.append(message)
    return out


def prompts_of(body: CompletionBody) -> list[str | list[int]]:
    """A completion's prompts: one text, one token list, or a list of either (a choice block per prompt)."""
    prompt = body.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise invalid("prompt must not be empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]
