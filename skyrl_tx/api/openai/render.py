"""OpenAI response bodies from the engine's sample results: completions and chat completions, whole or as the
server-sent-event chunks of `stream: true`, with logprobs and usage."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from skyrl_tx.api.openai.schemas import SamplingSpec
from skyrl_tx.api.openai.text import ModelText, cut_completion, text_deltas
from skyrl_tx.finite_json import finite_json


@dataclass
class Choice:
    """One sampled sequence as OpenAI returns it."""

    index: int
    tokens: list[int]  # the tokens whose text is returned (a trailing EOS / stop token left out)
    logprobs: list[float]
    text: str
    finish_reason: str
    generated: int  # every token the engine generated for it (usage counts them all, the stop token included)
    top: list[list[tuple[int, float]]] | None = None  # per kept token, its most likely alternatives (top_logprobs)


def choices(text: ModelText, spec: SamplingSpec, results: list[dict[str, Any]]) -> list[Choice]:
    """Choices in OpenAI's order: prompt i's n sequences take indices i*n … i*n+n-1."""
    out = []
    for i, result in enumerate(results):
        for j, seq in enumerate(result["sequences"]):
            kept, body, reason = cut_completion(text, list(seq["tokens"]), seq["stop_reason"], spec.stop_strings,
                                                spec.stop_ids)
            top = seq.get("topk_logprobs")
            alternatives = None if top is None else [[tuple(pair) for pair in t] for t in top[: len(kept)]]
            out.append(Choice(i * spec.n + j, kept, list(seq["logprobs"] or [])[: len(kept)], body, reason,
                              len(seq["tokens"]), alternatives))
    return out


def usage(prompt_lengths: list[int], picked: list[Choice]) -> dict[str, int]:
    prompt, completion = sum(prompt_lengths), sum(c.generated for c in picked)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# ---- completions ---------------------------------------------------------------------------------
def completion_logprobs(text: ModelText, c: Choice, start: int = 0, end: int | None = None) -> dict[str, Any]:
    """The legacy completions shape for tokens[start:end]; top_logprobs (token text -> logprob per position) when
    `logprobs` > 0 asked for alternatives, else None."""
    tokens = c.tokens[start:end]
    pieces = [text.token_text(t) for t in tokens]
    offsets, at = [], 0
    for piece in [text.token_text(t) for t in c.tokens[:start]]:
        at += len(piece)
    for piece in pieces:
        offsets.append(at)
        at += len(piece)
    top = None if c.top is None else [{text.token_text(t): lp for t, lp in alternatives}
                                      for alternatives in c.top[start:end]]
    return {"tokens": pieces, "token_logprobs": c.logprobs[start:end], "top_logprobs": top, "text_offset": offsets}


def completion(text: ModelText, spec: SamplingSpec, model: str, picked: list[Choice],
               prompt_lengths: list[int]) -> dict[str, Any]:
    return {"id": new_id("cmpl"), "object": "text_completion", "created": int(time.time()), "model": model,
            "system_fingerprint": None,
            "choices": [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason, "stop_reason": None,
                         "logprobs": completion_logprobs(text, c) if spec.logprobs else None} for c in picked],
            "usage": usage(prompt_lengths, picked)}


def completion_chunks(text: ModelText, spec: SamplingSpec, model: str, picked: list[Choice],
                      prompt_lengths: list[int]) -> Iterator[dict[str, Any]]:
    """One chunk per generated token of each choice (its text delta), a final chunk per choice with its
    finish_reason, then a usage chunk (choices []) when stream_options.include_usage asked for it."""
    base = {"id": new_id("cmpl"), "object": "text_completion", "created": int(time.time()), "model": model,
            "system_fingerprint": None}
    for c in picked:
        for k, delta in enumerate(text_deltas(text, c.tokens, c.text)):
            lp = completion_logprobs(text, c, k, k + 1) if spec.logprobs else None
            yield {**base, "choices": [{"index": c.index, "text": delta, "logprobs": lp, "finish_reason": None}]}
        yield {**base, "choices": [{"index": c.index, "text": "", "logprobs": None, "finish_reason": c.finish_reason}]}
    if spec.include_usage:
        yield {**base, "choices": [], "usage": usage(prompt_lengths, picked)}


# ---- chat completions ----------------------------------------------------------------------------
def chat_logprobs(text: ModelText, c: Choice, start: int = 0, end: int | None = None) -> dict[str, Any]:
    tops = c.top[start:end] if c.top is not None else [[] for _ in c.tokens[start:end]]
    return {"content": [{"token": text.token_text(t), "logprob": lp, "bytes": text.token_bytes(t),
                         "top_logprobs": [{"token": text.token_text(a), "logprob": alp, "bytes": text.token_bytes(a)}
                                          for a, alp in top]}
                        for t, lp, top in zip(c.tokens[start:end], c.logprobs[start:end], tops)], "refusal": None}


def chat_completion(text: ModelText, spec: SamplingSpec, model: str, picked: list[Choice],
                    prompt_length: int) -> dict[str, Any]:
    return {"id": new_id("chatcmpl"), "object": "chat.completion", "created": int(time.time()), "model": model,
            "system_fingerprint": None,
            "choices": [{"index": c.index, "finish_reason": c.finish_reason,
                         "message": {"role": "assistant", "content": c.text, "refusal": None, "tool_calls": []},
                         "logprobs": chat_logprobs(text, c) if spec.logprobs else None} for c in picked],
            "usage": usage([prompt_length], picked)}


def chat_chunks(text: ModelText, spec: SamplingSpec, model: str, picked: list[Choice],
                prompt_length: int) -> Iterator[dict[str, Any]]:
    """Per choice: a role chunk, one content chunk per generated token, a finish chunk; then usage if asked."""
    base = {"id": new_id("chatcmpl"), "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "system_fingerprint": None}
    for c in picked:
        yield {**base, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}]}
        for k, delta in enumerate(text_deltas(text, c.tokens, c.text)):
            lp = chat_logprobs(text, c, k, k + 1) if spec.logprobs else None
            yield {**base, "choices": [{"index": c.index, "delta": {"content": delta}, "logprobs": lp,
                                        "finish_reason": None}]}
        yield {**base, "choices": [{"index": c.index, "delta": {}, "logprobs": None,
                                    "finish_reason": c.finish_reason}]}
    if spec.include_usage:
        yield {**base, "choices": [], "usage": usage([prompt_length], picked)}


def sse(chunks: Iterator[dict[str, Any]]) -> Iterator[bytes]:
    """Server-sent events as OpenAI sends them: `data: {json}` per chunk, `data: [DONE]` at the end."""
    for chunk in chunks:
        yield f"data: {json.dumps(finite_json(chunk), ensure_ascii=False, allow_nan=False)}\n\n".encode()
    yield b"data: [DONE]\n\n"
