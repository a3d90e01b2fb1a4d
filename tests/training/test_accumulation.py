"""Gradients accumulate across forward_backward calls until optim_step; zero weights and forward change nothing."""

from __future__ import annotations

import pytest
import torch
from train_reference import (
    ROBUST_ADAM,
    SAME_MATH_ATOL,
    STEP_ATOL,
    assert_dicts_close,
    assert_dicts_equal,
    assert_results_equal,
    assert_zero,
    create_lora_with_nonzero_b,
    make_datums,
    our_logprobs,
    random_sequences,
)

from skyrl_tx.backend.native import NativeBackend
from skyrl_tx.config import BackendSettings
from skyrl_tx.types import AdamParams, TrainRequest, TrainResult

PRESETS = ["tiny-qwen3", "tiny-llama3"]
RANK, ALPHA = 4, 8.0


@pytest.fixture(params=PRESETS)
def backend(request: pytest.FixtureRequest, tiny_model_dir) -> NativeBackend:
    return NativeBackend(tiny_model_dir(request.param), BackendSettings(max_lora_adapters=4, max_lora_rank=8))


def lora(backend: NativeBackend, model_id: str) -> dict[str, torch.Tensor]:
    """Every model of these tests has the same A (seed 3) and B (b_seed 4), so models are twins."""
    return create_lora_with_nonzero_b(backend, model_id, rank=RANK, alpha=ALPHA, seed=3, b_seed=4)


def datums(backend: NativeBackend, model_id: str, loss_fn: str, lengths: list[int], seed: int) -> list:
    """Datums of different lengths; RL sampling logprobs are our own forward's logprobs plus noise."""
    seqs = random_sequences(backend.decoder_config.vocab_size, lengths, seed)
    return make_datums(loss_fn, seqs, our_logprobs(backend, model_id, seqs), seed + 1)


def mixed_data(backend: NativeBackend, model_id: str, seed: int) -> tuple[list, list]:
    """6 cross_entropy datums and 3 ppo datums of different lengths."""
    return (datums(backend, model_id, "cross_entropy", [4, 9, 13, 2, 7, 11], seed),
            datums(backend, model_id, "ppo", [5, 10, 8], seed + 2))


def concat_results(parts: list[list[TrainResult]], request_index: int) -> TrainResult:
    outputs = [out for part in parts for out in part[request_index].loss_fn_outputs]
    return TrainResult(outputs, {"loss:sum": sum(part[request_index].metrics["loss:sum"] for part in parts)})


def test_three_calls_equal_one_call(backend: NativeBackend) -> None:
    state = lora(backend, "split")
    assert_dicts_equal(lora(backend, "whole"), state, "twin models")
    ce, ppo = mixed_data(backend, "whole", seed=0)

    parts = []
    for k in range(3):
        parts.append(backend.forward_backward([TrainRequest("split", ce[2 * k:2 * k + 2]),
                                               TrainRequest("split", [ppo[k]], "ppo")]))
    whole = backend.forward_backward([TrainRequest("whole", ce), TrainRequest("whole", ppo, "ppo")])

    assert_results_equal([concat_results(parts, 0), concat_results(parts, 1)], whole, atol=SAME_MATH_ATOL)
    split_grads, whole_grads = backend.trainable_grads("split"), backend.trainable_grads("whole")
    assert_dicts_close(split_grads, whole_grads, SAME_MATH_ATOL, "accumulated grads")
    assert max(g.abs().max().item() for g in whole_grads.values()) > 1e-2

    m_split = backend.optim_step("split", ROBUST_ADAM)
    m_whole = backend.optim_step("whole", ROBUST_ADAM)
    assert m_split["grad_norm"] == pytest.approx(m_whole["grad_norm"], rel=1e-5)
    stepped = backend.trainable_state("whole")
    assert_dicts_close(backend.trainable_state("split"), stepped, STEP_ATOL, "weights after the step")
    assert max((stepped[k] - state[k]).abs().max().item() for k in state) > 1e-4, "the step moved the weights"
    assert_zero(backend.trainable_grads("split"))
    assert_zero(backend.trainable_grads("whole"))


def test_accumulation_is_a_sum_of_calls(backend: NativeBackend) -> None:
    """The same request twice accumulates exactly twice its gradient (no averaging over calls)."""
    lora(backend, "twice")
    lora(backend, "once")
    ce, _ = mixed_data(backend, "once", seed=10)
    request = TrainRequest("twice", ce[:3])
    backend.forward_backward([request])
    backend.forward_backward([request])
    backend.forward_backward([TrainRequest("once", ce[:3])])
    once = backend.trainable_grads("once")
    doubled = {k: 2 * v for k, v in once.items()}
    assert_dicts_close(backend.trainable_grads("twice"), doubled, SAME_MATH_ATOL, "2x grads")


def test_zero_weights_change_nothing(backend: NativeBackend) -> None:
    state = lora(backend, "zero")
    ce, ppo = mixed_data(backend, "zero", seed=20)
    for datum in ce + ppo:
        datum.loss_fn_inputs["weights"] = torch.zeros(len(datum.input_tokens))
    results = backend.forward_backward([TrainRequest("zero", ce), TrainRequest("zero", ppo, "ppo")])
    for result in results:
        assert result.metrics["loss:sum"] == 0.0
        for out in result.loss_fn_outputs:
            assert not out["elementwise_loss"].any()
            assert (out["logprobs"] < 0).all(), "logprobs are still computed"
    assert_zero(backend.trainable_grads("zero"))

    # Zero gradients, no weight decay: Adam's update is 0 / (0 + eps) and clipping a zero norm must not divide by 0.
    metrics = backend.optim_step("zero", AdamParams(learning_rate=1e-2, weight_decay=0.0, grad_clip_norm=1.0))
    assert metrics["grad_norm"] == 0.0
    assert_dicts_equal(backend.trainable_state("zero"), state, "weights after a zero-gradient step")


def test_forward_has_no_side_effects(backend: NativeBackend) -> None:
    state = lora(backend, "fwd")
    ce, ppo = mixed_data(backend, "fwd", seed=30)
    requests = [TrainRequest("fwd", ce[:4]), TrainRequest("fwd", ppo, "ppo"), TrainRequest("fwd", ce[4:]),
                TrainRequest("fwd", datums(backend, "fwd", "dro", [7, 3], seed=31), "dro", {"beta": 0.1})]

    before = backend.forward(requests)
    assert_zero(backend.trainable_grads("fwd"), "grads after forward on a fresh model")
    assert_dicts_equal(backend.trainable_state("fwd"), state, "weights after forward")

    trained = backend.forward_backward(requests)
    grads = backend.trainable_grads("fwd")
    assert any(g.any() for g in grads.values())
    assert_results_equal(before, trained)  # forward and forward_backward compute the same outputs, bit for bit

    other = TrainRequest("fwd", datums(backend, "fwd", "cispo", [6, 3], seed=33), "cispo")
    backend.forward([other])
    assert_dicts_equal(backend.trainable_grads("fwd"), grads, "grads after forward")
    assert_dicts_equal(backend.trainable_state("fwd"), state, "weights after forward")
    assert_results_equal(backend.forward(requests), trained)
