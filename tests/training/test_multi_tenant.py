"""Several LoRA tenants in one forward_backward: same as each alone, isolated optimizer steps, clean slot reuse."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from train_reference import (
    ROBUST_ADAM,
    SAME_MATH_ATOL,
    STEP_ATOL,
    assert_dicts_close,
    assert_dicts_equal,
    assert_results_close,
    assert_results_equal,
    assert_zero,
    clone_dict,
    create_lora_with_nonzero_b,
    grads_of,
    make_datums,
    peft_copy,
    peft_lora_parameters,
    random_sequences,
    reference_pass,
    target_modules,
    true_logprobs,
)

from skyrl_tx.backend.native import NativeBackend
from skyrl_tx.config import BackendSettings
from skyrl_tx.types import AdamParams, TrainRequest

PRESETS = ["tiny-qwen3", "tiny-llama3"]
SETTINGS = BackendSettings(max_lora_adapters=4, max_lora_rank=8)
# id → (rank, alpha, seed, target flags): different ranks, scalings, seeds and target groups.
TENANTS = {
    "t1": (1, 2.0, 1, {}),
    "t2": (2, 2.0, 2, {"train_mlp": False}),
    "t3": (4, 8.0, 3, {"train_attn": False, "train_unembed": False}),
    "t4": (8, 4.0, 4, {}),
}


@pytest.fixture(params=PRESETS)
def path(request: pytest.FixtureRequest, tiny_model_dir) -> Path:
    return tiny_model_dir(request.param)


def create_tenants(backend: NativeBackend) -> dict[str, dict[str, torch.Tensor]]:
    return {tid: create_lora_with_nonzero_b(backend, tid, rank=rank, alpha=alpha, seed=seed, b_seed=10 + seed,
                                            **flags)
            for tid, (rank, alpha, seed, flags) in TENANTS.items()}


def tenant_requests(vocab: int, peft_models: dict, seed: int) -> list[TrainRequest]:
    """Requests of every tenant (t1 twice), different losses and lengths, interleaved."""
    plan = [("t1", "cross_entropy", [5, 11]), ("t2", "ppo", [9]), ("t3", "dro", [3, 14]), ("t4", "cispo", [7]),
            ("t1", "importance_sampling", [12, 1]), ("t3", "cross_entropy", [6])]
    requests = []
    for i, (tid, loss_fn, lengths) in enumerate(plan):
        seqs = random_sequences(vocab, lengths, seed + i)
        data = make_datums(loss_fn, seqs, true_logprobs(peft_models[tid], seqs), seed + 50 + i)
        requests.append(TrainRequest(tid, data, loss_fn))
    return requests


def peft_copies(path: Path, states: dict[str, dict[str, torch.Tensor]]) -> dict:
    """One PEFT model per tenant; peft_copy checks the trainable_state names follow the tenant's target groups."""
    return {tid: peft_copy(path, states[tid], rank=TENANTS[tid][0], alpha=TENANTS[tid][1],
                           modules=target_modules(**TENANTS[tid][3])) for tid in TENANTS}


def test_mixed_tenants_equal_each_tenant_alone(path: Path) -> None:
    combined, single = NativeBackend(path, SETTINGS), NativeBackend(path, SETTINGS)
    states = create_tenants(combined)
    for tid, (rank, alpha, seed, flags) in TENANTS.items():
        single.create_model(tid, lora_rank=rank, alpha=alpha, seed=seed, **flags)
        single.set_adapter_weights(tid, states[tid])
    peft_models = peft_copies(path, states)
    requests = tenant_requests(combined.decoder_config.vocab_size, peft_models, seed=0)

    got = combined.forward_backward(requests)
    for tid in TENANTS:
        index = [i for i, r in enumerate(requests) if r.model_id == tid]
        alone = single.forward_backward([requests[i] for i in index])
        assert_results_equal([got[i] for i in index], alone, atol=SAME_MATH_ATOL)
        grads = combined.trainable_grads(tid)
        assert_dicts_close(grads, single.trainable_grads(tid), SAME_MATH_ATOL, f"{tid} grads")
        # ... and both are right: the tenant's PEFT copy with its own rank, scaling and target modules.
        expected = reference_pass(peft_models[tid], [requests[i] for i in index], backward=True)
        assert_results_close([got[i] for i in index], expected, 1e-5)
        assert_dicts_close(grads, grads_of(peft_lora_parameters(peft_models[tid])), 1e-5, f"{tid} vs PEFT")


def test_optim_step_touches_only_its_tenant(path: Path) -> None:
    backend = NativeBackend(path, SETTINGS)
    states = create_tenants(backend)
    vocab = backend.decoder_config.vocab_size
    seqs = random_sequences(vocab, [8, 15], seed=5)
    base_before = backend.token_logprobs([s[:-1] for s in seqs], [s[1:] for s in seqs])
    requests = tenant_requests(vocab, peft_copies(path, states), seed=1)
    backend.forward_backward(requests)
    grads = {tid: backend.trainable_grads(tid) for tid in TENANTS}
    for tid in TENANTS:
        assert any(g.any() for g in grads[tid].values()), f"{tid} got gradients"

    metrics = backend.optim_step("t1", AdamParams(learning_rate=1e-2, weight_decay=0.1, grad_clip_norm=0.5))
    assert metrics["grad_norm"] > 0
    assert_zero(backend.trainable_grads("t1"), "t1 grads after its step")
    t1 = backend.trainable_state("t1")
    assert max((t1[k] - states["t1"][k]).abs().max().item() for k in t1) > 1e-3, "t1 moved"
    for tid in ("t2", "t3", "t4"):
        assert_dicts_equal(backend.trainable_state(tid), states[tid], f"{tid} weights after stepping t1")
        assert_dicts_equal(backend.trainable_grads(tid), grads[tid], f"{tid} grads after stepping t1")

    backend.forward_backward([r for r in requests if r.model_id == "t1"])  # a pass of t1 alone
    for tid in ("t2", "t3", "t4"):
        assert_dicts_equal(backend.trainable_grads(tid), grads[tid], f"{tid} grads after a pass of t1")
    base_after = backend.token_logprobs([s[:-1] for s in seqs], [s[1:] for s in seqs])
    for before, after in zip(base_before, base_after):
        assert torch.equal(before, after), "LoRA training changed the base model"


def test_freed_slot_starts_clean(path: Path) -> None:
    backend = NativeBackend(path, SETTINGS)
    states = create_tenants(backend)  # all 4 slots taken
    vocab = backend.decoder_config.vocab_size
    requests = tenant_requests(vocab, peft_copies(path, states), seed=2)
    # Leave t3 dirty: moved weights, Adam moments, step count and pending gradients.
    t3_requests = [r for r in requests if r.model_id == "t3"]
    backend.forward_backward(t3_requests)
    backend.optim_step("t3", ROBUST_ADAM)
    backend.forward_backward(t3_requests)
    others = {tid: (clone_dict(backend.trainable_state(tid)), clone_dict(backend.trainable_grads(tid)))
              for tid in ("t1", "t2", "t4")}
    backend.remove_model("t3")

    rank, alpha = TENANTS["t3"][0], TENANTS["t3"][1]  # same shapes as the dirty tenant, all target groups
    backend.create_model("new", lora_rank=rank, alpha=alpha, seed=99)  # the only free slot is t3's
    fresh = NativeBackend(path, SETTINGS)
    fresh.create_model("new", lora_rank=rank, alpha=alpha, seed=99)

    state = backend.trainable_state("new")
    assert_dicts_equal(state, fresh.trainable_state("new"), "a reused slot vs a fresh backend")
    assert_zero({k: v for k, v in state.items() if ".lora_B." in k}, "B of a new adapter")
    assert_zero(backend.trainable_grads("new"), "grads of a new adapter")
    seqs = random_sequences(vocab, [9, 4], seed=6)
    inputs, targets = [s[:-1] for s in seqs], [s[1:] for s in seqs]
    for base, new in zip(backend.token_logprobs(inputs, targets), backend.token_logprobs(inputs, targets, ["new"] * 2)):
        assert torch.equal(base, new), "a new adapter computes the base model"

    # Two optimizer rounds equal a fresh model's: no stale Adam moments or step count in the slot.
    data = [TrainRequest("new", make_datums("cross_entropy", seqs, [torch.zeros(9), torch.zeros(4)], seed=7))]
    for step in range(2):
        assert_results_equal(backend.forward_backward(data), fresh.forward_backward(data), atol=SAME_MATH_ATOL)
        assert_dicts_close(backend.trainable_grads("new"), fresh.trainable_grads("new"), SAME_MATH_ATOL,
                           f"step {step} grads")
        backend.optim_step("new", ROBUST_ADAM)
        fresh.optim_step("new", ROBUST_ADAM)
        assert_dicts_close(backend.trainable_state("new"), fresh.trainable_state("new"), STEP_ATOL, f"step {step}")
    moved = backend.trainable_state("new")
    assert max((moved[k] - state[k]).abs().max().item() for k in state) > 1e-3

    for tid, (weights, grads) in others.items():
        assert_dicts_equal(backend.trainable_state(tid), weights, f"{tid} weights")
        assert_dicts_equal(backend.trainable_grads(tid), grads, f"{tid} grads")
