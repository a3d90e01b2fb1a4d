"""Turns stored requests (JSON metadata + binary body) into backend calls, and backend results into stored results.

The one place that reads a stored request: the engine loop and replay after a restart both go through here. A
forward / forward_backward is stored as the SDK's ForwardBackwardRequest protobuf (`request_body`) beside small
JSON metadata; its result is stored as the ForwardBackwardOutput protobuf that retrieve_future sends as is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from sqlalchemy import Engine

from skyrl_tx.db import future_queries
from skyrl_tx.db.future_queries import FutureRow
from skyrl_tx.types import (AdamParams, CustomLossGraph, Datum, DimuonParams, OptimParams, SampleRequest,
                            SampleResult, SamplingParams, TrainRequest, TrainResult)
from skyrl_tx.wire import codec

# Tinker trains LoRA with a fixed alpha and 1/r scaling, so the learning rate transfers across ranks
# (Thinking Machines, "LoRA Without Regret", 2025).
LORA_ALPHA = 32.0

TORCH_DTYPES = {"float32": torch.float32, "int64": torch.int64}


def _json_tensor(spec: dict[str, Any]) -> torch.Tensor:
    values = torch.tensor(spec["values"], dtype=TORCH_DTYPES[spec["dtype"]])
    shape = spec.get("shape") or [len(spec["values"])]
    return values.reshape(shape)


def _array_tensor(spec: dict[str, Any]) -> torch.Tensor:
    # The codec's arrays are read-only views of the body: one copy makes them the backend's own tensors.
    return torch.from_numpy(np.array(spec["values"]).reshape(spec["shape"]))


def custom_loss_graph(loss_id: str, request: dict[str, Any]) -> CustomLossGraph:
    """A create_custom_loss future's stored request (api/routes/custom_losses.py) as the graph the backend rebuilds."""
    return CustomLossGraph(loss_id, request["name"], tuple(i["name"] for i in request["inputs"]),
                           tuple(int(i["rank"]) for i in request["inputs"]), request["nodes"])


def train_request(request: dict[str, Any], body: bytes | None = None,
                  custom_loss: CustomLossGraph | None = None) -> TrainRequest:
    """A stored forward / forward_backward: `request` is its JSON column, `body` its request_body (None for rows
    stored before binary bodies, whose datums are in the JSON); `custom_loss` the graph a "custom" one names."""
    if body is None:
        data = [Datum(torch.tensor(d["input_tokens"], dtype=torch.int64),
                      {name: _json_tensor(spec) for name, spec in d["loss_fn_inputs"].items()})
                for d in request["data"]]
    else:
        decoded = codec.decode_forward_backward_request(body, None)  # checked by the API before it was stored
        data = [Datum(torch.from_numpy(d["input_tokens"].astype(np.int64)),  # [n] int64
                      {name: _array_tensor(spec) for name, spec in d["loss_fn_inputs"].items()})
                for d in decoded["data"]]
    if request["loss_fn"] == "custom":  # its config is the loss_id, resolved into `custom_loss` by the caller
        return TrainRequest(request["model_id"], data, "custom", {}, custom_loss)
    config = {k: float(v) for k, v in (request.get("loss_fn_config") or {}).items()}
    return TrainRequest(request["model_id"], data, request["loss_fn"], config)


def train_requests(database: Engine, futures: Sequence[FutureRow]) -> list[TrainRequest]:
    """The TrainRequests of stored forward / forward_backward rows (FutureRow: id and request are enough), their
    binary bodies loaded in one query: the engine's scan reads metadata only."""
    ids = [f.id for f in futures if "data" not in f.request]
    needed = {_loss_id(f.request) for f in futures} - {None}
    if len(_GRAPHS) + len(needed) > MAX_GRAPHS:  # rare (an RL run creates a handful): re-read what is used next
        _GRAPHS.clear()
    missing = sorted(needed - _GRAPHS.keys())
    bodies: dict[str, bytes] = {}
    if ids or missing:
        with database.connect() as db:
            if ids:
                bodies = {id_: bytes(body) for id_, body in db.execute(future_queries.REQUEST_BODIES, {"ids": ids})}
            # A loss's graph never changes once created: read once per engine, not per forward_backward. (The API
            # checked each id is a completed create_custom_loss of the model's session.)
            for id_, request in db.execute(future_queries.REQUESTS_OF, {"ids": missing}) if missing else ():
                _GRAPHS[id_] = custom_loss_graph(id_, request)
    return [train_request(f.request, bodies.get(f.id), _GRAPHS.get(_loss_id(f.request) or "")) for f in futures]


MAX_GRAPHS = 256
_GRAPHS: dict[str, CustomLossGraph] = {}  # loss_id -> graph


def _loss_id(request: dict[str, Any]) -> str | None:
    return (request.get("loss_fn_config") or {}).get("loss_id") if request["loss_fn"] == "custom" else None


def train_result(result: TrainResult) -> bytes:
    """The stored (and sent) form of a forward / forward_backward result: a ForwardBackwardOutput protobuf, made
    from the tensors' bytes (no Python lists of floats)."""
    outputs = [{name: t.detach().to("cpu", torch.float32).numpy() for name, t in out.items()}
               for out in result.loss_fn_outputs]
    return codec.encode_forward_backward_output(outputs, result.metrics)


def adam_params(request: dict[str, Any]) -> AdamParams:
    return AdamParams(**{k: float(v) for k, v in request["adam_params"].items()})


def optim_params(request: dict[str, Any]) -> OptimParams:
    """An optim_step job's AdamParams, or its DimuonParams (job key "optimizer_params", checked by the API)."""
    if request.get("optimizer_params") is not None:
        return DimuonParams(**{k: float(v) for k, v in request["optimizer_params"].items() if k != "type"})
    return adam_params(request)


def sample_request(request: dict[str, Any]) -> SampleRequest:
    p = request["sampling_params"]
    max_tokens = p.get("max_tokens")
    params = SamplingParams(max_tokens=16 if max_tokens is None else int(max_tokens),
                            temperature=float(p.get("temperature", 1.0)), top_k=int(p.get("top_k", -1)),
                            top_p=float(p.get("top_p", 1.0)), seed=p.get("seed"), stop=p.get("stop"))
    targets = request.get("target_prompt_logprobs")
    return SampleRequest(request["prompt_tokens"], params, num_samples=int(request.get("num_samples", 1)),
                         weights_id=request.get("weights_id", ""),
                         prompt_logprobs=bool(request.get("prompt_logprobs", False)),
                         topk_prompt_logprobs=int(request.get("topk_prompt_logprobs", 0)),
                         prompt_logprobs_last_n=int(request.get("prompt_logprobs_last_n") or 0),
                         target_prompt_token_ids=None if targets is None else targets["ids"],
                         prompt_alt_tokens_k=int(request.get("prompt_alt_tokens_k", 0)),
                         topk_sample_logprobs=int(request.get("topk_sample_logprobs", 0)),
                         stream=bool(request.get("stream", False)))


def sample_result(result: SampleResult, request: dict[str, Any] | None = None) -> dict[str, Any]:
    """The stored (JSON) form of a sample result. Array fields use TensorData's JSON shape (data, dtype, shape);
    target logprobs keep the layout the request used (a sparse CSR request gets its listed cells back)."""
    out: dict[str, Any] = {
        "sequences": [{"tokens": s.tokens, "logprobs": s.logprobs, "stop_reason": s.stop_reason,
                       **({"topk_logprobs": s.topk_logprobs} if s.topk_logprobs is not None else {})}
                      for s in result.sequences],
        "prompt_logprobs": result.prompt_logprobs,
        "topk_prompt_logprobs": result.topk_prompt_logprobs,
        "prompt_cache_hit_tokens": result.prompt_cache_hit_tokens}
    if result.target_prompt_logprobs is not None:
        layout = ((request or {}).get("target_prompt_logprobs") or {}).get("sparse")
        out["target_prompt_logprobs"] = _tensor_json(result.target_prompt_logprobs, "float32", layout)
    if result.prompt_alt_tokens is not None:
        ids, logprobs = result.prompt_alt_tokens
        out["prompt_alt_tokens"] = {"tokens": _tensor_json(ids, "int64"), "logprobs": _tensor_json(logprobs, "float32")}
    return out


def _tensor_json(rows: list[list[Any]], dtype: str, sparse: dict[str, list[int]] | None = None) -> dict[str, Any]:
    """A 2-D list as TensorData JSON; with `sparse` (crow/col indices), only the listed cells, CSR order."""
    shape = [len(rows), len(rows[0]) if rows else 0]
    if sparse is None:
        return {"data": [v for row in rows for v in row], "dtype": dtype, "shape": shape}
    crow, col = sparse["crow_indices"], sparse["col_indices"]
    data = [rows[r][col[i]] for r in range(len(rows)) for i in range(crow[r], crow[r + 1])]
    return {"data": data, "dtype": dtype, "shape": shape, "sparse_crow_indices": crow, "sparse_col_indices": col}
