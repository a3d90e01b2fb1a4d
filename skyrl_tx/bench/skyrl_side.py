"""The skyrl_tx side of each workload: one NativeBackend call sequence per repetition, as the engine would issue it."""

from __future__ import annotations

from pathlib import Path

import torch

from skyrl_tx.bench import workloads as wl
from skyrl_tx.bench.configs import BenchConfig


def preload() -> None:
    """Imports and loads the extension before the memory baseline is taken."""
    from skyrl_tx._ext import load_extension
    from skyrl_tx.backend import native  # noqa: F401

    load_extension()


def _backend(model_dir: Path, cfg: BenchConfig, device: str, workload: str, new_tokens: int,
             overrides: dict | None = None):
    from skyrl_tx.backend.native import NativeBackend
    from skyrl_tx.config import BackendSettings

    w = cfg.workload
    # Adapter slots (stacked at max rank), snapshot slots and the KV cache are static reservations: sized for
    # this workload, as a deployment sizes them for its traffic. Micro-batches: on a CPU the GEMMs reach the
    # core's peak from a few hundred rows, so one sequence per micro-batch costs no speed and bounds the
    # activations (the README's CPU advice); a GPU needs the whole batch in one pass to fill its SMs.
    batch = wl.sample_batch(workload)
    micro_batch_tokens = w.train_seq_len if device == "cpu" else max(8192, w.train_batch * w.train_seq_len)
    sized = dict(max_lora_adapters=wl.num_adapters(workload), max_lora_rank=w.lora_rank, max_resident_snapshots=1,
                 dtype=cfg.dtype, device=device, max_sampling_sequences=batch,
                 max_sampling_length=w.sample_prompt_len + max(new_tokens, 1),
                 train_micro_batch_tokens=micro_batch_tokens)
    settings = BackendSettings.from_dict({**sized, **(overrides or {})})  # validated like --backend-config
    return NativeBackend(model_dir, settings)


def _add_adapter(backend, name: str, cfg: BenchConfig, seed: int) -> None:
    rank = cfg.workload.lora_rank
    backend.create_model(name, lora_rank=rank, alpha=2.0 * rank, seed=seed)
    shapes = {k: tuple(v.shape) for k, v in backend.adapter_state_dict(name).items()}
    backend.set_adapter_weights(name, wl.random_lora_factors(shapes, seed))


def build(workload: str, model_dir: Path, cfg: BenchConfig, device: str,
          new_tokens: int | None = None, backend_overrides: dict | None = None) -> wl.Prepared:
    """The workload on a fresh backend. Sampling runs `new_tokens` per sequence (default: the config's);
    `backend_overrides`: extra BackendSettings keys."""
    from skyrl_tx.types import AdamParams, Datum, SampleRequest, SamplingParams, TrainRequest

    data = wl.train_data(workload, cfg) if wl.is_training(workload) else wl.sample_data(workload, cfg, new_tokens)
    backend = _backend(model_dir, cfg, device, workload, data.new_tokens if isinstance(data, wl.SampleData) else 1,
                       backend_overrides)
    names = [f"adapter-{i}" for i in range(wl.num_adapters(workload))]
    for i, name in enumerate(names):
        _add_adapter(backend, name, cfg, seed=i + 1)

    if isinstance(data, wl.TrainData):
        def datum(row: torch.Tensor) -> Datum:
            return Datum(row[:-1], {"target_tokens": row[1:], "weights": torch.ones(row.numel() - 1)})

        requests = [TrainRequest(name, [datum(row) for row in block]) for name, block in zip(names, data.per_adapter)]
        params = AdamParams(learning_rate=wl.LEARNING_RATE, beta1=wl.BETAS[0], beta2=wl.BETAS[1], eps=wl.EPS)

        def train_rep() -> None:
            backend.forward_backward(requests)  # every adapter's rows in one batch
            for name in names:
                backend.optim_step(name, params)

        return wl.Prepared(train_rep, data.tokens)

    counter = iter(range(1 << 30))

    def sample_rep(new: int = data.new_tokens) -> None:
        rep = next(counter)
        requests = [SampleRequest(prompt, SamplingParams(max_tokens=new, temperature=1.0, seed=rep * 1000 + i,
                                                         stop=[]), weights_id=names[0])
                    for i, prompt in enumerate(data.prompts)]
        out = backend.sample(requests)
        produced = sum(len(s.tokens) for r in out for s in r.sequences)
        if produced != new * len(requests):
            raise RuntimeError(f"skyrl_tx sampled {produced} tokens, expected {new * len(requests)}")

    return wl.Prepared(sample_rep, data.tokens, lambda: sample_rep(1))
