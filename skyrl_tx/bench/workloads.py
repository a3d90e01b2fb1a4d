"""The measured workloads (names, sizes, deterministic token data), shared by both sides of the comparison."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from skyrl_tx.bench.configs import BenchConfig

TRAIN_1 = "train_1_adapter"
TRAIN_N = "train_4_adapters"
TRAIN_8 = "train_8_adapters"
SAMPLE_1 = "sample_batch_1"
SAMPLE_16 = "sample_batch_16"
SAMPLE_64 = "sample_batch_64"
WORKLOADS = (TRAIN_1, TRAIN_N, TRAIN_8, SAMPLE_1, SAMPLE_16, SAMPLE_64)
CPU_WORKLOADS = (TRAIN_1, TRAIN_N, SAMPLE_1, SAMPLE_16)  # the GPU adds the 8-adapter batch and decode at batch 64
_ADAPTERS = {TRAIN_N: 4, TRAIN_8: 8}
_SAMPLE_BATCH = {SAMPLE_1: 1, SAMPLE_16: 16, SAMPLE_64: 64}
TOKEN_RANGE = 2000  # ids drawn from [0, 2000): inside every config's tokenizer, away from the special tokens
LEARNING_RATE = 1e-4  # AdamW as the Tinker SDK defaults it: betas (0.9, 0.95), eps 1e-12, no weight decay
BETAS = (0.9, 0.95)
EPS = 1e-12


@dataclasses.dataclass(frozen=True)
class TrainData:
    """Per adapter, a [rows, seq_len + 1] block of tokens: inputs are [:, :-1], targets [:, 1:] (all weight 1)."""

    per_adapter: list[torch.Tensor]

    @property
    def tokens(self) -> int:
        return sum(int(t[:, 1:].numel()) for t in self.per_adapter)


@dataclasses.dataclass(frozen=True)
class SampleData:
    prompts: torch.Tensor  # [batch, prompt_len]
    new_tokens: int

    @property
    def tokens(self) -> int:
        return int(self.prompts.size(0)) * self.new_tokens


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A built workload: `run` is one timed repetition over `tokens` tokens; sampling workloads also have
    `run_first_token`, the same requests stopped after one new token (prefill + one step), to isolate decode."""

    run: Callable[[], None]
    tokens: int
    run_first_token: Callable[[], None] | None = None


def default_workloads(device: str) -> tuple[str, ...]:
    return CPU_WORKLOADS if device == "cpu" else WORKLOADS


def is_training(workload: str) -> bool:
    return workload in (TRAIN_1, TRAIN_N, TRAIN_8)


def num_adapters(workload: str) -> int:
    return _ADAPTERS.get(workload, 1)


def sample_batch(workload: str) -> int:
    return _SAMPLE_BATCH.get(workload, 1)


def train_data(workload: str, cfg: BenchConfig) -> TrainData:
    """The same total tokens either way: one adapter gets `train_batch` rows; N adapters split them evenly."""
    w = cfg.workload
    adapters = num_adapters(workload)
    rows = max(1, w.train_batch // adapters)
    gen = torch.Generator().manual_seed(1234)
    return TrainData([torch.randint(0, TOKEN_RANGE, (rows, w.train_seq_len + 1), generator=gen)
                      for _ in range(adapters)])


def sample_data(workload: str, cfg: BenchConfig, new_tokens: int | None = None) -> SampleData:
    w = cfg.workload
    gen = torch.Generator().manual_seed(4321)
    prompts = torch.randint(0, TOKEN_RANGE, (sample_batch(workload), w.sample_prompt_len), generator=gen)
    return SampleData(prompts, w.sample_new_tokens if new_tokens is None else new_tokens)


def random_lora_factors(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    """Nonzero A and B (a fresh adapter has B = 0, which no side may shortcut); same values for both sides."""
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) * 0.02 for name, shape in sorted(shapes.items())}
