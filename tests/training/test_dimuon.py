"""Dimuon (optim/dimuon.h) equals a plain-PyTorch reference over 3 steps with clipping; its momentum round-trips
through the checkpoint files; a model's optimizer is fixed (wrong params, wrong state, full fine-tuning refused)."""

from __future__ import annotations

import math

import pytest
import torch
from train_reference import create_lora_with_nonzero_b, make_datums, our_logprobs, random_sequences

from skyrl_tx._ext import load_extension
from skyrl_tx.backend.native import NativeBackend
from skyrl_tx.checkpoints import formats
from skyrl_tx.config import BackendSettings
from skyrl_tx.errors import InvalidArgumentError
from skyrl_tx.types import AdamParams, DimuonParams, TrainRequest

RANK, ALPHA = 4, 8.0
NS_A, NS_B, NS_C, NS_STEPS, NS_EPS = 3.4445, -4.7750, 2.0315, 5, 1e-7  # Keller Jordan's Muon


def reference_orthogonalise(m: torch.Tensor) -> torch.Tensor:
    """One matrix at a time (the core batches by shape): the wide orientation, Frobenius-normalised, 5 quintic
    Newton–Schulz steps, oriented back."""
    wide = m.T if m.shape[0] > m.shape[1] else m  # [r, k], r <= k
    x = wide / (torch.linalg.matrix_norm(wide) + NS_EPS)
    for _ in range(NS_STEPS):
        gram = x @ x.T
        x = NS_A * x + (NS_B * gram + NS_C * gram @ gram) @ x
    return x.T if m.shape[0] > m.shape[1] else x


class ReferenceDimuon:
    """Plain PyTorch Dimuon as the README states it: global-norm clipping (torch's clip_grad_norm_ rule),
    EMA momentum m ← β1·m + (1−β1)·g (no Nesterov, no bias correction), W ← W − lr·NS(m) for A and B
    alike; in float64, so the comparison measures the core's float32 rounding."""

    def __init__(self, weights: dict[str, torch.Tensor]):
        self.weights = {k: v.clone().double() for k, v in weights.items()}
        self.momentum = {k: torch.zeros_like(v) for k, v in self.weights.items()}
        self.steps = 0

    def step(self, grads: dict[str, torch.Tensor], p: DimuonParams) -> float:
        norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))
        scale = min(1.0, p.grad_clip_norm / (norm + 1e-6)) if p.grad_clip_norm > 0 else 1.0
        for name, g in grads.items():
            self.momentum[name] = p.beta1 * self.momentum[name] + (1 - p.beta1) * scale * g.double()
            self.weights[name] -= p.learning_rate * reference_orthogonalise(self.momentum[name])
        self.steps += 1
        return norm


@pytest.fixture
def backend(tiny_model_dir) -> NativeBackend:
    return NativeBackend(tiny_model_dir("tiny-qwen3"), BackendSettings(max_lora_adapters=4, max_lora_rank=8))


def dimuon_lora(backend: NativeBackend, model_id: str) -> dict[str, torch.Tensor]:
    """A Dimuon LoRA model with random nonzero B (so A gets gradients at the first step too)."""
    state = create_lora_with_nonzero_b(backend, model_id, rank=RANK, alpha=ALPHA, seed=3, b_seed=4)
    backend._core.set_optimizer_kind(model_id, "dimuon")
    assert backend.optimizer_kind(model_id) == "dimuon"
    return state


def train_batch(backend: NativeBackend, model_id: str, seed: int) -> None:
    seqs = random_sequences(backend.decoder_config.vocab_size, [7, 12, 5], seed)
    datums = make_datums("cross_entropy", seqs, our_logprobs(backend, model_id, seqs), seed + 1)
    backend.forward_backward([TrainRequest(model_id, datums, "cross_entropy")])


def test_newton_schulz_orthogonalises() -> None:
    """The core's batched iteration equals the per-matrix reference, and leaves singular values near 1 (the
    quintic's known band), so a full-rank r × k direction has Frobenius norm ≈ √r."""
    x = torch.randn(3, RANK, 40, generator=torch.Generator().manual_seed(0))
    out = load_extension().newton_schulz(x)
    for i in range(3):
        torch.testing.assert_close(out[i], reference_orthogonalise(x[i]), rtol=0, atol=1e-5)
        s = torch.linalg.svdvals(out[i])
        assert s.min() > 0.6 and s.max() < 1.25, s
    assert torch.equal(load_extension().newton_schulz(torch.zeros(1, 2, 5)), torch.zeros(1, 2, 5))  # no NaN


def test_three_steps_equal_reference_with_clipping(backend: NativeBackend) -> None:
    weights = dimuon_lora(backend, "m")
    reference = ReferenceDimuon(weights)
    schedule = [DimuonParams(learning_rate=0.02, grad_clip_norm=0.05, beta1=0.9),  # clips (checked below)
                DimuonParams(learning_rate=0.01, grad_clip_norm=0.0, beta1=0.8),
                DimuonParams(learning_rate=0.005, grad_clip_norm=-1.0, beta1=0.95)]  # nonpositive = no clipping
    for step, params in enumerate(schedule, start=1):
        train_batch(backend, "m", seed=10 * step)
        grads = backend.trainable_grads("m")
        expected_norm = reference.step(grads, params)
        metrics = backend.optim_step("m", params)
        assert metrics["step"] == step and metrics["learning_rate"] == params.learning_rate
        assert metrics["grad_norm"] == pytest.approx(expected_norm, rel=1e-6)
        if step == 1:
            assert expected_norm > params.grad_clip_norm * 2  # the clipping branch really ran
        after = backend.trainable_state("m")
        for name, w in after.items():
            torch.testing.assert_close(w.double(), reference.weights[name], rtol=0, atol=1e-5, msg=name)
        # Each factor moved by lr·(a direction of Frobenius norm ≈ √rank), A and B alike.
        moved = [float(torch.linalg.matrix_norm(after[n] - weights[n])) / params.learning_rate for n in after]
        assert all(0.5 * math.sqrt(RANK) < d < 1.25 * math.sqrt(RANK) for d in moved), moved
        weights = after
    state = backend.optimizer_state("m")
    assert state.kind == "dimuon" and state.step == 3 and not state.exp_avg
    for name, m in state.momentum.items():
        torch.testing.assert_close(m.double(), reference.momentum["base_model.model." + name], rtol=0, atol=1e-6)


def test_momentum_round_trips_through_checkpoint_files(backend: NativeBackend) -> None:
    """optimizer.safetensors holds the momentum and the kind; restored into a fresh Dimuon model, the next step
    is the same as the original's, bit for bit."""
    dimuon_lora(backend, "a")
    for step in range(2):
        train_batch(backend, "a", seed=step)
        backend.optim_step("a", DimuonParams(learning_rate=0.01))
    files = formats.optimizer_files(backend.optimizer_state("a"))
    raw = files[formats.OPTIMIZER_FILE].to_bytes()
    saved = formats.read_optimizer(lambda name: raw)
    assert saved["kind"] == "dimuon" and saved["step"] == 2 and saved["momentum"] and not saved["exp_avg"]

    backend.create_model("b", lora_rank=RANK, alpha=ALPHA, seed=3, optimizer="dimuon")
    backend.set_trainable_state("b", backend.trainable_state("a"))
    backend.restore_optimizer("b", saved)
    restored = backend.optimizer_state("b")
    original = backend.optimizer_state("a")
    assert restored.kind == "dimuon" and restored.step == 2
    assert original.momentum.keys() == restored.momentum.keys()
    for name in original.momentum:
        assert torch.equal(original.momentum[name], restored.momentum[name]), name
    for model in ("a", "b"):
        train_batch(backend, model, seed=7)
        assert backend.optim_step(model, DimuonParams(learning_rate=0.01))["step"] == 3
    sa, sb = backend.trainable_state("a"), backend.trainable_state("b")
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name

    backend.create_model("adam", lora_rank=RANK, alpha=ALPHA, seed=3)  # AdamW: Dimuon state is refused
    with pytest.raises(InvalidArgumentError, match="holds dimuon optimizer state.*uses adamw"):
        backend.restore_optimizer("adam", saved)


def test_optimizer_is_fixed_per_model(backend: NativeBackend) -> None:
    backend.create_model("d", lora_rank=RANK, alpha=ALPHA, optimizer="dimuon")
    backend.create_model("w", lora_rank=RANK, alpha=ALPHA)
    with pytest.raises(InvalidArgumentError, match="uses the dimuon optimizer.*not adam_params"):
        backend.optim_step("d", AdamParams())
    with pytest.raises(InvalidArgumentError, match="uses the adamw optimizer.*send adam_params"):
        backend.optim_step("w", DimuonParams())
    with pytest.raises(InvalidArgumentError, match="beta1"):
        backend.optim_step("d", DimuonParams(beta1=1.0))
    with pytest.raises(InvalidArgumentError, match="learning_rate"):
        backend.optim_step("d", DimuonParams(learning_rate=float("nan")))
    with pytest.raises(InvalidArgumentError, match="full fine-tuning"):
        backend.create_model("full", lora_rank=0, optimizer="dimuon")
    assert backend.optimizer_state("d").step == 0  # refused steps changed nothing
