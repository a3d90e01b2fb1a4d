"""Turns stored request JSON into backend calls and backend results into stored result JSON."""

from __future__ import annotations

from typing import Any

import torch

from skyrl_tx.types import AdamParams, Datum, SampleRequest, SampleResult, SamplingParams, TrainRequest, TrainResult

# Tinker trains LoRA with a fixed alpha and 1/r scaling, so the learning rate transfers across ranks
# (Thinking Machines, "LoRA Without Regret", 2025).
LORA_ALPHA = 32.0

TORCH_DTYPES = {"float32": torch.float32, "int64": torch.int64}


def _tensor(spec: dict[str, Any]) -> torch.Tensor:
    values = torch.tensor(spec["values"], dtype=TORCH_DTYPES[spec["dtype"]])
    shape = spec.get("shape") or [len(spec["values"])]
    return values.reshape(shape)


def train_request(request: dict[str, Any]) -> TrainRequest:
    data = [Datum(torch.tensor(d["input_tokens"], dtype=torch.int64),
                  {name: _tensor(spec) for name, spec in d["loss_fn_inputs"].items()})
            for d in request["data"]]
    config = {k: float(v) for k, v in (request.get("loss_fn_config") or {}).items()}
    return TrainRequest(request["model_id"], data, request["loss_fn"], config)


def train_result(result: TrainResult) -> dict[str, Any]:
    return {"loss_fn_outputs": [{name: t.tolist() for name, t in out.items()} for out in result.loss_fn_outputs],
            "metrics": result.metrics}


def adam_params(request: dict[str, Any]) -> AdamParams:
    return AdamParams(**{k: float(v) for k, v in request["adam_params"].items()})


def sample_request(request: dict[str, Any]) -> SampleRequest:
    p = request["sampling_params"]
    max_tokens = p.get("max_tokens")
    params = SamplingParams(max_tokens=16 if max_tokens is None else int(max_tokens), temperature=float(p.get("temperature", 1.0)),
                            top_k=int(p.get("top_k", -1)), top_p=float(p.get("top_p", 1.0)), seed=p.get("seed"),
                            stop=p.get("stop"))
    return SampleRequest(request["prompt_tokens"], params, num_samples=int(request.get("num_samples", 1)),
                         weights_id=request.get("weights_id", ""),
                         prompt_logprobs=bool(request.get("prompt_logprobs", False)),
                         topk_prompt_logprobs=int(request.get("topk_prompt_logprobs", 0)))


def sample_result(result: SampleResult) -> dict[str, Any]:
    return {"sequences": [{"tokens": s.tokens, "logprobs": s.logprobs, "stop_reason": s.stop_reason}
                          for s in result.sequences],
            "prompt_logprobs": result.prompt_logprobs,
            "topk_prompt_logprobs": result.topk_prompt_logprobs}
