"""Every preset beyond the plain dense decoder (MoE: tiny-qwen3-moe, tiny-deepseek-v3; hybrid linear attention:
tiny-qwen3.5, tiny-qwen3.5-moe) against Hugging Face transformers: logprobs, padded and mixed-adapter batches,
a random adapter on every LoRA module, LoRA gradients and two AdamW steps. Architecture-specific checks live in
test_moe_models.py and test_qwen3_5_models.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from backend_parity import ALPHA, RANK, ours, random_adapter, seqs_of
from hf_reference import hf_token_logprobs, load_hf_model
from moe_reference import MergedLoraModel, expert_factor_names
from train_reference import (
    assert_close,
    assert_dicts_close,
    check_two_adamw_steps,
    grads_of,
    make_datums,
    random_sequences,
    reference_pass,
    true_logprobs,
)

from skyrl_tx.backend.native import NativeBackend
from skyrl_tx.types import TrainRequest

PRESETS = ["tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-qwen3.5", "tiny-qwen3.5-moe"]
ATOL = 1e-5


@pytest.fixture(scope="module", params=PRESETS)
def path(request: pytest.FixtureRequest, tiny_model_dir) -> Path:
    return tiny_model_dir(request.param)


@torch.no_grad()
def merged_logprobs(hf: torch.nn.Module, state: dict[str, torch.Tensor], scale: float, seq: list[int]):
    return hf_token_logprobs(MergedLoraModel(hf, state, scale), seq)


# Lengths around the delta rule's 64-token chunk (Qwen3.5): inside one, exactly one, one past, several, a ragged tail.
@pytest.mark.parametrize("lengths", [[2, 7, 33], [64, 65], [130, 200]])
def test_base_logprobs_match_transformers(backend: NativeBackend, hf: torch.nn.Module, lengths: list[int]) -> None:
    seqs = seqs_of(backend.decoder_config.vocab_size, lengths, seed=len(lengths) + lengths[0])
    for seq, got in zip(seqs, ours(backend, seqs)):
        assert_close(got, hf_token_logprobs(hf, seq), ATOL)


def test_padded_batch_equals_each_sequence_alone(backend: NativeBackend) -> None:
    seqs = seqs_of(backend.decoder_config.vocab_size, [5, 70, 2, 17], seed=1)
    for seq, got in zip(seqs, ours(backend, seqs)):
        assert_close(got, ours(backend, [seq])[0], 1e-6)


def test_adapter_on_every_module_equals_merged_transformers(backend: NativeBackend, hf: torch.nn.Module) -> None:
    state = random_adapter(backend, "merged", 3, RANK, ALPHA)
    try:
        seqs = seqs_of(backend.decoder_config.vocab_size, [3, 21, 80], seed=2)
        got = ours(backend, seqs, ["merged"] * len(seqs))
        for seq, lp in zip(seqs, got):
            assert_close(lp, merged_logprobs(hf, state, ALPHA / RANK, seq), ATOL)
        assert (got[-1] - ours(backend, seqs[-1:])[0]).abs().max() > 1e-3, "the adapter changes the output"
    finally:
        backend.remove_model("merged")


def test_mixed_adapter_batch_equals_rows_alone(backend: NativeBackend, hf: torch.nn.Module) -> None:
    states = {"x": random_adapter(backend, "x", 10, 2, 4.0),
              "y": random_adapter(backend, "y", 11, 8, 8.0, train_attn=False, train_unembed=False)}
    scales = {"x": 2.0, "y": 1.0}
    try:
        seqs = seqs_of(backend.decoder_config.vocab_size, [12, 5, 66, 8, 19], seed=5)
        adapters = ["y", "", "x", "y", "x"]
        for seq, adapter, got in zip(seqs, adapters, ours(backend, seqs, adapters)):
            assert_close(got, ours(backend, [seq], [adapter])[0], 1e-6)
            ref = merged_logprobs(hf, states[adapter], scales[adapter], seq) if adapter else hf_token_logprobs(hf, seq)
            assert_close(got, ref, ATOL)
    finally:
        backend.remove_model("x")
        backend.remove_model("y")


def test_lora_gradients_and_adamw_equal_merged_autograd(backend: NativeBackend, path: Path) -> None:
    state = random_adapter(backend, "train", 21, RANK, ALPHA)
    try:
        ref = MergedLoraModel(load_hf_model(path), state, ALPHA / RANK)
        vocab = backend.decoder_config.vocab_size
        plan = [[("cross_entropy", [9, 1, 70])], [("cross_entropy", [6, 11]), ("importance_sampling", [8])]]
        requests = []
        for step, per_step in enumerate(plan):
            batch = []
            for i, (loss_fn, lengths) in enumerate(per_step):
                seqs = random_sequences(vocab, lengths, 30 + 10 * step + i)
                batch.append(TrainRequest("train", make_datums(loss_fn, seqs, true_logprobs(ref, seqs),
                                                               40 + 10 * step + i), loss_fn))
            requests.append(batch)
        backend.forward_backward(requests[0])
        reference_pass(ref, requests[0], backward=True)
        grads = backend.trainable_grads("train")
        # Every module's factors get real gradients; most experts are hit by some weighted token of this batch.
        experts = set(expert_factor_names(grads))
        assert all(grads[k].abs().max() > 0 for k in grads if k not in experts), "every non-expert factor trains"
        assert not experts or sum(grads[k].abs().max() > 0 for k in experts) > 0.5 * len(experts)
        assert_dicts_close(grads, grads_of(ref.factors), ATOL, "first pass grads")
        # Start the two-step AdamW check from scratch (same data again).
        backend.remove_model("train")
        state = random_adapter(backend, "train", 21, RANK, ALPHA)
        ref = MergedLoraModel(load_hf_model(path), state, ALPHA / RANK)
        # Step 2: tiny-qwen3.5-moe (4 routed layers and 3 DeltaNets) measured 2.0e-5 x scale on one expert's B with
        # one thread (step 1 and the first pass stay within 1e-5).
        check_two_adamw_steps(backend, "train", ref, ref.factors, requests[0], requests[1], ATOL, second_atol=3e-5)
    finally:
        backend.remove_model("train")
