"""Edge checks of request values the engine cannot use: ids out of range, non-finite numbers, empty or too long data.

Each raises InvalidArgumentError naming the field and its valid range (a 400), so bad input never reaches the
idempotency hash (canonical JSON refuses NaN) or the engine (a NaN learning rate poisons an adapter for good)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from skyrl_tx.errors import InvalidArgumentError
from skyrl_tx.types import AdamParams

INT64_MAX = 2**63 - 1
# futures.seq_id is an INTEGER column: 32-bit on PostgreSQL. A client's counter starts at 0 and counts calls.
SEQ_ID_MAX = 2**31 - 1
SEED_MAX = INT64_MAX  # the C++ sampler and LoRA initialisation take a signed 64-bit seed


def check_int_range(value: Any, name: str, low: int, high: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidArgumentError(f"{what}: {name} must be an integer in [{low}, {high}] (got {value!r})")
    return value


def check_seq_id(value: Any, what: str, name: str = "seq_id") -> int:
    """A per-model request counter: 0 or more, and storable."""
    return check_int_range(value, name, 0, SEQ_ID_MAX, what)


def check_model_seq_id(value: Any, what: str, name: str = "model_seq_id") -> int:
    """A client counter that only becomes part of an id string: any non-negative signed 64-bit integer."""
    return check_int_range(value, name, 0, INT64_MAX, what)


def check_seed(value: Any, what: str, name: str = "seed") -> int | None:
    if value is None:
        return None
    return check_int_range(value, name, 0, SEED_MAX, what)


def check_finite(value: Any, name: str, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgumentError(f"{what}: {name} must be a number (got {value!r})")
    if not math.isfinite(value):
        raise InvalidArgumentError(f"{what}: {name} must be a finite number (got {value!r}); NaN and infinity "
                                   "are not accepted")
    return float(value)


def check_finite_mapping(values: Mapping[str, Any] | None, name: str, what: str) -> None:
    """Every number of a flat config (loss_fn_config) finite; strings pass (the engine checks keys and kinds)."""
    for key, value in (values or {}).items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            check_finite(value, f"{name}[{key!r}]", what)


def check_json_finite(value: Any, name: str, what: str) -> None:
    """Free-form JSON (user_metadata): no NaN or infinity anywhere (PostgreSQL's JSON refuses them, and so does
    the canonical JSON of the idempotency hash)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidArgumentError(f"{what}: {name} holds {value!r}; JSON values must be finite numbers")
    if isinstance(value, dict):
        for key, item in value.items():
            check_json_finite(item, f"{name}[{key!r}]", what)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_json_finite(item, f"{name}[{i}]", what)


def check_adam(params: AdamParams, what: str = "optim_step") -> None:
    """Values AdamW can only turn into NaN (or a step against the gradient) are refused before they reach a model."""
    for name in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"):
        check_finite(getattr(params, name), f"adam_params.{name}", what)
    rules = (
        (params.learning_rate >= 0, "learning_rate must be >= 0"),
        (0 <= params.beta1 < 1, "beta1 must be in [0, 1)"),
        (0 <= params.beta2 < 1, "beta2 must be in [0, 1)"),
        (params.eps > 0, "eps must be > 0 (it keeps the update finite where the second moment is 0)"),
        (params.weight_decay >= 0, "weight_decay must be >= 0"),
        (params.grad_clip_norm >= 0, "grad_clip_norm must be >= 0 (0 = no clipping)"),
    )
    for ok, rule in rules:
        if not ok:
            raise InvalidArgumentError(f"{what}: adam_params.{rule} (got {params})")


def check_sampling_params(params: Mapping[str, Any], what: str = "asample") -> None:
    for name in ("temperature", "top_p"):
        if name in params and params[name] is not None:
            check_finite(params[name], f"sampling_params.{name}", what)
    check_seed(params.get("seed"), what, "sampling_params.seed")
    for name in ("max_tokens", "top_k"):  # the engine checks their meaning; beyond int64 they cannot even reach it
        if params.get(name) is not None:
            check_int_range(params[name], f"sampling_params.{name}", -INT64_MAX - 1, INT64_MAX, what)
    stop = params.get("stop") or []
    for i, token in enumerate(stop):
        if not isinstance(token, str):
            check_int_range(token, f"sampling_params.stop[{i}]", -INT64_MAX - 1, INT64_MAX, what)


def check_sample_request(prompt_tokens: list[int], num_samples: int, topk_prompt_logprobs: int,
                         what: str = "asample") -> None:
    """Integers the engine takes as int64: outside that range they fail in conversion, not as a user error."""
    check_int_range(num_samples, "num_samples", 1, INT64_MAX, what)
    check_int_range(topk_prompt_logprobs, "topk_prompt_logprobs", 0, INT64_MAX, what)
    for i, token in enumerate(prompt_tokens):
        if not -INT64_MAX - 1 <= token <= INT64_MAX:
            check_int_range(token, f"prompt token {i}", -INT64_MAX - 1, INT64_MAX, what)


# |value| above this can only overflow the engine's float32 math: the loss sums weight * logprob over the
# sequence, and the gradient norm sums squares of values proportional to it (1e12 squared is 1e24, leaving ~1e14
# of headroom below float32's 3.4e38). Real weights and advantages are many orders of magnitude smaller.
MAX_LOSS_INPUT = 1e12


def check_datums(data: list[dict[str, Any]], max_positions: int, what: str) -> None:
    """forward / forward_backward datums as wire/codec.py decodes them: at least one, each no longer than the model's
    positions, every float loss input finite and within MAX_LOSS_INPUT (larger ones can only give inf/NaN)."""
    if not data:
        raise InvalidArgumentError(f"{what}: the request has no datums; send at least one")
    for i, datum in enumerate(data):
        length = len(datum["input_tokens"])
        if length == 0:
            raise InvalidArgumentError(f"{what}: datum {i} has an empty model_input; send at least one token")
        if length > max_positions:
            raise InvalidArgumentError(f"{what}: datum {i} has {length} tokens, more than the model's "
                                       f"{max_positions} positions (max_position_embeddings); split or truncate it")
        for name, tensor in datum["loss_fn_inputs"].items():
            if tensor["dtype"] != "float32":
                continue
            values = tensor["values"]  # 1-D float32 numpy array
            if values.size and not np.isfinite(values).all():
                raise InvalidArgumentError(f"{what}: datum {i} loss_fn_inputs[{name!r}] holds NaN or infinity; "
                                           "send finite numbers")
            if values.size and float(np.abs(values).max()) > MAX_LOSS_INPUT:
                raise InvalidArgumentError(f"{what}: datum {i} loss_fn_inputs[{name!r}] holds a value of magnitude "
                                           f"{float(np.abs(values).max()):.3g}, above {MAX_LOSS_INPUT:g}: the loss "
                                           "would overflow to infinity; scale it down")
