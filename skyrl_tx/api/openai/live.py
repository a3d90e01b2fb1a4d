"""`stream: true` as the engine decodes: one server-sent-event chunk per decode step that adds text to a choice,
then the rest of each choice's text, its finish_reason and (when asked) usage, as the whole answer would have them.

Text is sent only once it is final: the newest token of a choice is held back (it may be a stop token whose text is
cut), and so are the last (longest stop string - 1) characters (they may begin a stop string) and a trailing partial
UTF-8 character. So the chunks join to exactly the non-streamed text. With `logprobs` the stream is built from the
finished result instead (render.completion_chunks / chat_chunks): the decode steps report tokens, not logprobs.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from skyrl_tx.api.openai import render
from skyrl_tx.api.openai.errors import OpenAIError, error_body, from_skyrl
from skyrl_tx.api.openai.sampling import stream_sample
from skyrl_tx.api.openai.schemas import SamplingSpec
from skyrl_tx.api.openai.text import ModelText
from skyrl_tx.api.principal import Principal
from skyrl_tx.errors import SkyrlTxError
from skyrl_tx.finite_json import finite_json


def _event(chunk: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(finite_json(chunk), ensure_ascii=False, allow_nan=False)}\n\n".encode()


class _Shape:
    """Chunk bodies of one endpoint: completions (`text`) or chat completions (`delta`)."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat = chat
        self.base = {"id": render.new_id("chatcmpl" if chat else "cmpl"),
                     "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
                     "model": model, "system_fingerprint": None}

    def opening(self, index: int) -> dict[str, Any] | None:
        if not self.chat:
            return None
        return {**self.base, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}]}

    def text(self, index: int, delta: str) -> dict[str, Any]:
        body = {"delta": {"content": delta}} if self.chat else {"text": delta}
        return {**self.base, "choices": [{"index": index, **body, "logprobs": None, "finish_reason": None}]}

    def finish(self, index: int, reason: str) -> dict[str, Any]:
        body = {"delta": {}} if self.chat else {"text": ""}
        return {**self.base, "choices": [{"index": index, **body, "logprobs": None, "finish_reason": reason}]}


async def live_sse(request: Request, who: Principal, spec: SamplingSpec, weights_id: str, text: ModelText,
                   model: str, prompts: list[list[int]], limits: list[int], chat: bool) -> AsyncIterator[bytes]:
    shape = _Shape(chat, model)
    hold = max((len(s) for s in spec.stop_strings), default=1) - 1
    tokens: dict[int, list[int]] = {}
    sent: dict[int, str] = {}
    for index in range(len(prompts) * spec.n):
        opening = shape.opening(index)
        if opening is not None:
            yield _event(opening)
    try:
        async for event in stream_sample(request, who, spec, weights_id, prompts, limits):
            if event[0] == "tokens":
                _, prompt_index, new = event
                for sample_index, added in enumerate(new):
                    index = prompt_index * spec.n + sample_index
                    so_far = tokens.setdefault(index, [])
                    so_far.extend(added)
                    visible = text.decode(so_far[:-1]).rstrip("\ufffd")  # the newest token may be cut yet
                    visible = visible[: max(len(visible) - hold, 0)]
                    already = sent.get(index, "")
                    if len(visible) > len(already) and visible.startswith(already):
                        sent[index] = visible
                        yield _event(shape.text(index, visible[len(already):]))
                continue
            picked = await asyncio.to_thread(render.choices, text, spec, event[1])
            for choice in picked:
                already = sent.get(choice.index, "")
                rest = choice.text[len(already):] if choice.text.startswith(already) else ""
                if rest:
                    yield _event(shape.text(choice.index, rest))
                yield _event(shape.finish(choice.index, choice.finish_reason))
            if spec.include_usage:
                yield _event({**shape.base, "choices": [], "usage": render.usage([len(p) for p in prompts], picked)})
    except (OpenAIError, SkyrlTxError) as exc:  # after the 200 went out: OpenAI's in-stream error event
        error = exc if isinstance(exc, OpenAIError) else from_skyrl(exc)
        yield _event(error_body(error.status, error.message, error.param))
    yield b"data: [DONE]\n\n"
