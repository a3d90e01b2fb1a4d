"""Conversions at NativeBackend's edge: skyrl_tx.types requests and results to and from the extension's types,
and PEFT tensor names to and from the core's module names."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from skyrl_tx._ext import load_extension
from skyrl_tx.errors import InvalidArgumentError
from skyrl_tx.types import (
    CustomLossGraph,
    Datum,
    SampledSequence,
    SampleRequest,
    SampleResult,
    TrainRequest,
    TrainResult,
)

PEFT_PREFIX = "base_model.model."


def token_tensor(tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
    return tokens.to(torch.int64) if isinstance(tokens, torch.Tensor) else torch.tensor(list(tokens), dtype=torch.int64)


# A vision-language checkpoint's text model (Qwen3.5 on the hub) is model.language_model.*; the core's is model.*.
VL_TEXT_PREFIX = "model.language_model."


def core_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """PEFT names → the core's module names (a vision-language checkpoint's model.language_model.* → model.*).
    PEFT's `<module>.base_layer.weight` copies (saved when lm_head is a target, meant for resized vocabularies) are
    skipped: the base model never changes here."""
    out = {}
    for name, value in tensors.items():
        if name.endswith(".base_layer.weight"):
            continue
        name = name.removeprefix(PEFT_PREFIX)
        out["model." + name.removeprefix(VL_TEXT_PREFIX) if name.startswith(VL_TEXT_PREFIX) else name] = value
    return out


def peft_names(tensors: dict[str, torch.Tensor], text_prefix: str = "model.") -> dict[str, torch.Tensor]:
    """LoRA factors get PEFT's 'base_model.model.' prefix, and the base checkpoint's text-model prefix
    (`text_prefix`: models.checkpoint.stored_text_prefix); full fine-tuning keeps HF names."""
    if any(".lora_" in name for name in tensors):
        return {PEFT_PREFIX + (text_prefix + k.removeprefix("model.") if k.startswith("model.") else k): v
                for k, v in tensors.items()}
    return dict(tensors)


def _loss_input(name: str, value: list | torch.Tensor) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    return torch.tensor(value, dtype=torch.int64 if name == "target_tokens" else torch.float32)


def _native_datum(datum: Datum):
    inputs = {k: _loss_input(k, v) for k, v in datum.loss_fn_inputs.items()}
    return load_extension().TrainDatum(token_tensor(datum.input_tokens), inputs)


def native_request(request: TrainRequest, custom_losses: CustomLossCache):
    native = load_extension().TrainRequest(request.model_id, [_native_datum(d) for d in request.data],
                                           request.loss_fn, dict(request.loss_fn_config or {}))
    if request.custom_loss is not None:
        native.custom_loss = custom_losses.get(request.custom_loss)
    return native


class CustomLossCache:
    """Custom losses rebuilt by the core (_C.CustomLoss.from_wire), by loss_id: a loss is rebuilt once, not per
    request. Bounded: an RL run creates a handful; the oldest goes first."""

    def __init__(self, capacity: int = 256):
        self._capacity, self._losses = capacity, {}

    def get(self, graph: CustomLossGraph) -> Any:
        loss = self._losses.pop(graph.loss_id, None)
        if loss is None:
            loss = load_extension().CustomLoss.from_wire(graph.name, list(graph.input_names), list(graph.input_ranks),
                                                         graph.nodes)
        self._losses[graph.loss_id] = loss  # most recently used last
        while len(self._losses) > self._capacity:
            self._losses.pop(next(iter(self._losses)))
        return loss


def train_results(native_results) -> list[TrainResult]:
    return [TrainResult(loss_fn_outputs=[{"logprobs": o.logprobs, "elementwise_loss": o.elementwise_loss}
                                         for o in r.loss_fn_outputs],
                        metrics=dict(r.metrics)) for r in native_results]


def native_sample_request(request: SampleRequest):
    _C = load_extension()
    params = _C.SamplingParams()
    p = request.sampling_params
    params.max_tokens, params.temperature, params.top_k, params.top_p = p.max_tokens, p.temperature, p.top_k, p.top_p
    params.seed = p.seed
    params.stop_at_eos = p.stop is None or len(p.stop) > 0
    stop = list(p.stop or [])
    if any(isinstance(s, str) for s in stop) and not all(isinstance(s, str) for s in stop):
        raise InvalidArgumentError("sample: stop must be all token ids or all strings")
    params.stop_strings = [s for s in stop if isinstance(s, str)]
    params.stop_tokens = [int(s) for s in stop if not isinstance(s, str)]
    native = _C.SampleRequest()
    native.weights_id, native.prompt = request.weights_id, token_tensor(request.prompt_tokens)
    native.num_samples, native.params = request.num_samples, params
    native.prompt_logprobs, native.topk_prompt_logprobs = request.prompt_logprobs, request.topk_prompt_logprobs
    native.prompt_logprobs_last_n = request.prompt_logprobs_last_n
    native.prompt_alt_tokens_k = request.prompt_alt_tokens_k
    native.topk_sample_logprobs = request.topk_sample_logprobs
    if request.target_prompt_token_ids is not None:
        native.target_prompt_token_ids = _target_ids_tensor(request.target_prompt_token_ids)
    return native


def _target_ids_tensor(rows: list[list[int]]) -> torch.Tensor:
    """[len(prompt) - 1, K] int64; ragged rows are the caller's error, named like the engine's other checks."""
    widths = {len(r) for r in rows}
    if len(widths) > 1:
        raise InvalidArgumentError(f"sample: target_prompt_logprobs rows must all have K entries (got lengths "
                                   f"{sorted(widths)})")
    return torch.tensor(rows, dtype=torch.int64).view(len(rows), widths.pop() if widths else 0)


def _topk_rows(ids: torch.Tensor, logprobs: torch.Tensor) -> list[list[tuple[int, float]] | None]:
    """[n, k] ids (-1 where a position was not scored) and logprobs -> per position (id, logprob) pairs or None."""
    return [None if row_ids[0] < 0 else list(zip(row_ids, row_lps))
            for row_ids, row_lps in zip(ids.tolist(), logprobs.tolist())]


def _sampled_sequence(native) -> SampledSequence:
    topk = None
    if native.topk_token_ids:
        ids, lps = native.topk_token_ids, native.topk_logprobs
        k = len(ids) // max(len(native.tokens), 1)
        topk = [list(zip(ids[i * k:(i + 1) * k], lps[i * k:(i + 1) * k])) for i in range(len(native.tokens))]
    return SampledSequence(list(native.tokens), list(native.logprobs), native.stop_reason, topk)


def sample_result(native) -> SampleResult:
    prompt_logprobs = None
    if native.prompt_logprobs is not None and native.prompt_logprobs.numel() > 0:  # NaN: not scored
        prompt_logprobs = [None if math.isnan(v) else v for v in native.prompt_logprobs.tolist()]
    topk = None
    if native.topk_prompt_token_ids is not None and native.topk_prompt_token_ids.numel() > 0:
        topk = _topk_rows(native.topk_prompt_token_ids, native.topk_prompt_logprobs)
    targets = None
    if native.target_prompt_logprobs is not None and native.target_prompt_logprobs.dim() == 2:
        targets = native.target_prompt_logprobs.tolist()
    alternatives = None
    if native.prompt_alt_token_ids is not None and native.prompt_alt_token_ids.dim() == 2:
        alternatives = (native.prompt_alt_token_ids.tolist(), native.prompt_alt_logprobs.tolist())
    return SampleResult(sequences=[_sampled_sequence(s) for s in native.sequences], prompt_logprobs=prompt_logprobs,
                        topk_prompt_logprobs=topk, target_prompt_logprobs=targets, prompt_alt_tokens=alternatives,
                        prompt_cache_hit_tokens=int(native.prompt_cache_hit_tokens))
