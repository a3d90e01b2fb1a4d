"""Internal request/result types shared by the API, the engine and the backend (no HTTP, no C++)."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: the API imports this module and must not load torch
    import torch

LOSS_FUNCTIONS = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce")


@dataclass
class Datum:
    """One training sequence, already shifted by the client: position i predicts target_tokens[i].

    loss_fn_inputs holds 1-D tensors (or lists) of the input's length: `target_tokens` (int) always,
    `weights` for cross_entropy, `logprobs` + `advantages` (+ optional `weights`) for the RL losses.
    """

    input_tokens: list[int] | torch.Tensor
    loss_fn_inputs: dict[str, list[float] | list[int] | torch.Tensor]


@dataclass(frozen=True)
class CustomLossGraph:
    """A create_custom_loss graph as the SDK sent it (plain data; the backend rebuilds it from its allow-list).
    `nodes` are the SDK's CustomLossGraph.nodes as JSON; `loss_id` names it (the create_custom_loss future's id)."""

    loss_id: str
    name: str
    input_names: tuple[str, ...]  # logprobs first
    input_ranks: tuple[int, ...]
    nodes: list[dict[str, Any]]


@dataclass
class TrainRequest:
    """forward / forward_backward of one model over its data with one loss function."""

    model_id: str
    data: list[Datum]
    loss_fn: str = "cross_entropy"
    loss_fn_config: dict[str, float] | None = None
    custom_loss: CustomLossGraph | None = None  # loss_fn "custom": the graph it runs per datum


@dataclass
class TrainResult:
    """Per datum `logprobs` and `elementwise_loss` (float32, the input's length); `name:reduction` metrics."""

    loss_fn_outputs: list[dict[str, torch.Tensor]]
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class AdamParams:
    """The SDK's AdamParams (decoupled weight decay; grad_clip_norm 0 = no clipping)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


@dataclass
class DimuonParams:
    """The SDK's DimuonParams (tinker 0.38); see optim/dimuon.h and the README's "Dimuon" for the update."""

    learning_rate: float = 1e-4
    grad_clip_norm: float = 0.0  # <= 0 = no clipping
    beta1: float = 0.9


OptimParams = AdamParams | DimuonParams


@dataclass
class SamplingParams:
    """The SDK's SamplingParams: temperature 0 = greedy; top_k <= 0 and top_p = 1 disable those cuts.

    `stop` holds token ids or strings (strings are matched on the decoded bytes of the completion).
    stop=None stops at the model's EOS; an explicit empty list disables every stop, EOS included (as the
    Tinker SDK defines it), so generation runs to max_tokens.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop: list[int] | list[str] | None = None


@dataclass
class SampleRequest:
    prompt_tokens: list[int] | torch.Tensor
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    num_samples: int = 1
    weights_id: str = ""  # "" base model, a live model id, or a snapshot id
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    prompt_logprobs_last_n: int = 0  # > 0: prompt (top-k) logprobs of the last N prompt tokens only
    target_prompt_token_ids: list[list[int]] | None = None  # [len(prompt) - 1][K]: ids scored at i + 1; -1 none
    prompt_alt_tokens_k: int = 0  # k draws at the request's temperature at every prompt position after the first
    topk_sample_logprobs: int = 0  # the k most likely tokens at every generated position
    # Streamed: the engine loop asks sample_progress for it (a sampler engine reports it every step from the first).
    stream: bool = False

    def seeded_from(self, seeds: random.Random) -> SampleRequest:
        """This request, or a copy seeded from `seeds` if it names no seed. Placements that spread requests over
        several generators (data-parallel replicas, sampler engines) seed them from one stream, as one process's
        generator would: each generator's own stream starts at the same seed, so they would draw the same samples."""
        if self.sampling_params.seed is not None:
            return self
        return dataclasses.replace(self, sampling_params=dataclasses.replace(self.sampling_params,
                                                                             seed=seeds.getrandbits(63)))


@dataclass
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" or "length"
    topk_logprobs: list[list[tuple[int, float]]] | None = None  # per generated token, when topk_sample_logprobs > 0


@dataclass
class SampleResult:
    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None  # prompt length; None where not scored (entry 0 always)
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None
    target_prompt_logprobs: list[list[float]] | None = None  # [len(prompt) - 1][K]; 0.0 where the id was -1
    prompt_alt_tokens: tuple[list[list[int]], list[list[float]]] | None = None  # ids, logprobs: [len(prompt) - 1][k]
    prompt_cache_hit_tokens: int = 0  # prompt tokens served from the prefix cache instead of prefilled


class FailedSample(SampleResult):
    """A sample request another sampler (external vLLM, a sampler engine process) failed: no sequences; the engine
    loop stores `error` on its future."""

    def __init__(self, error: BaseException):
        super().__init__([])
        self.error = error
