"""Packed training micro-batches (train_packed_sequences, the default: sequences back to back in one row, varlen
attention, Gated DeltaNet state restarted per sequence) equal right-padded ones: per-token logprobs and losses,
metrics and every LoRA gradient, for dense, MLA, MoE and hybrid linear-attention presets, with two adapters,
a sequence-level loss (gspo) and activation checkpointing. transformers parity of the packed path itself:
tests/models/test_architecture_parity.py and tests/backend/test_decoder_parity.py (both run the default)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from backend_parity import random_adapter
from train_reference import assert_close, assert_dicts_close, make_datums, random_sequences

from skyrl_tx.backend.native import NativeBackend
from skyrl_tx.config import BackendSettings
from skyrl_tx.types import TrainRequest

# Dense GQA, MLA + MoE, hybrid Gated DeltaNet (lengths straddle its 64-token chunk), routed MoE.
PRESETS = ["tiny-qwen3", "tiny-deepseek-v3", "tiny-qwen3.5", "tiny-qwen3-moe"]
ATOL = 2e-5


@pytest.fixture(scope="module", params=PRESETS)
def path(request: pytest.FixtureRequest, tiny_model_dir) -> Path:
    return tiny_model_dir(request.param)


def make_backend(path: Path, **settings) -> NativeBackend:
    backend = NativeBackend(path, BackendSettings(max_lora_adapters=3, max_lora_rank=8, **settings))
    random_adapter(backend, "a", seed=1)
    random_adapter(backend, "b", seed=2, rank=2, alpha=4.0)
    return backend


def requests_for(vocab: int) -> list[TrainRequest]:
    fake_lp = lambda seqs: [torch.full((len(s) - 1,), -2.0) for s in seqs]  # noqa: E731  (sampling logprobs' base)
    ce = random_sequences(vocab, [3, 70, 9], seed=3)
    # Equal lengths within an adapter (9, 9, 9; 17, 17; 1, 1) run as one batched call per run on the CPU.
    rl = random_sequences(vocab, [9, 130, 9, 5, 9], seed=4)
    ppo = random_sequences(vocab, [64, 1, 17, 1, 17], seed=5)
    return [TrainRequest("a", make_datums("cross_entropy", ce, fake_lp(ce), seed=6), "cross_entropy"),
            TrainRequest("b", make_datums("ppo", rl, fake_lp(rl), seed=7), "gspo"),
            TrainRequest("a", make_datums("ppo", ppo, fake_lp(ppo), seed=8), "ppo")]


def run(backend: NativeBackend, requests: list[TrainRequest]):
    results = backend.forward_backward(requests)
    return results, {m: backend.trainable_grads(m) for m in ("a", "b")}


def assert_same_pass(got, expected) -> None:
    (results, grads), (ref_results, ref_grads) = got, expected
    for r, (res, ref) in enumerate(zip(results, ref_results)):
        for d, (out, ref_out) in enumerate(zip(res.loss_fn_outputs, ref.loss_fn_outputs)):
            for key in ("logprobs", "elementwise_loss"):
                assert_close(out[key], ref_out[key], ATOL, f"request {r} datum {d} {key}")
        assert res.metrics.keys() == ref.metrics.keys()
        for key, value in ref.metrics.items():
            assert res.metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-4), f"request {r} {key}"
    for model_id in ref_grads:
        assert any(g.abs().max() > 0 for g in ref_grads[model_id].values()), f"{model_id} gets gradients"
        assert_dicts_close(grads[model_id], ref_grads[model_id], ATOL, f"{model_id} grads")


def test_packed_micro_batch_equals_padded_rows(path: Path) -> None:
    packed, padded = make_backend(path), make_backend(path, train_packed_sequences=False)
    assert packed.settings.train_packed_sequences, "packing is the default"
    requests = requests_for(packed.decoder_config.vocab_size)
    assert_same_pass(run(packed, requests), run(padded, requests))


def test_packed_checkpointed_layers_equal_packed(path: Path) -> None:
    plain, checkpointed = make_backend(path), make_backend(path, gradient_checkpointing=True)
    requests = requests_for(plain.decoder_config.vocab_size)
    assert_same_pass(run(checkpointed, requests), run(plain, requests))


def test_packed_micro_batches_respect_the_token_budget(path: Path) -> None:
    # 90 tokens per micro-batch: the 130-token datum alone, the rest packed around it; results still equal one
    # padded pass with no budget to speak of.
    small, padded = make_backend(path, train_micro_batch_tokens=90), make_backend(path, train_packed_sequences=False)
    requests = requests_for(small.decoder_config.vocab_size)
    assert_same_pass(run(small, requests), run(padded, requests))
