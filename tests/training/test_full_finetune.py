"""lora_rank=0 (full fine-tuning): HF-named weights, gradients and AdamW equal plain transformers + torch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_reference import load_hf_model
from train_reference import (
    assert_dicts_equal,
    assert_results_close,
    assert_zero,
    check_two_adamw_steps,
    create_lora_with_nonzero_b,
    hf_full_model,
    hf_parameters,
    make_datums,
    our_logprobs,
    random_sequences,
    reference_pass,
    true_logprobs,
    values_of,
)

from skyrl_tx.backend.native import NativeBackend
from skyrl_tx.config import BackendSettings
from skyrl_tx.types import AdamParams, TrainRequest

PRESETS = ["tiny-qwen3", "tiny-llama3"]  # untied lm_head / tied to the embedding (its gradient is the sum)
ATOL = 1e-5


@pytest.fixture(params=PRESETS)
def env(request: pytest.FixtureRequest, tiny_model_dir) -> tuple[Path, NativeBackend]:
    path = tiny_model_dir(request.param)
    return path, NativeBackend(path, BackendSettings(max_lora_adapters=2, max_lora_rank=8))


def requests_for(model_id: str, ref_model, vocab: int, plan, seed: int) -> list[TrainRequest]:
    requests = []
    for i, (loss_fn, lengths) in enumerate(plan):
        seqs = random_sequences(vocab, lengths, seed + i)
        requests.append(TrainRequest(model_id, make_datums(loss_fn, seqs, true_logprobs(ref_model, seqs), seed + 9 + i),
                                     loss_fn))
    return requests


def test_trainable_state_is_the_base_model_under_hf_names(env) -> None:
    path, backend = env
    backend.create_model("full", lora_rank=0)
    hf = load_hf_model(path)
    expected = values_of(hf_parameters(hf))
    state = backend.trainable_state("full")
    assert sorted(state) == sorted(expected)
    assert ("lm_head.weight" in state) == (not hf.config.tie_word_embeddings)
    assert "model.embed_tokens.weight" in state and "model.norm.weight" in state
    for name, tensor in state.items():
        assert tensor.dtype == torch.float32 and tensor.device.type == "cpu", name
        assert torch.equal(tensor, expected[name]), f"{name} is not the checkpoint's weight"
    assert_zero(backend.trainable_grads("full"), "grads of a fresh full model")


def test_gradients_and_adamw_match_transformers(env) -> None:
    path, backend = env
    backend.create_model("full", lora_rank=0)
    hf = hf_full_model(path)
    params = hf_parameters(hf)
    vocab = backend.decoder_config.vocab_size
    first = requests_for("full", hf, vocab, [("cross_entropy", [9, 1, 14])], seed=0)
    second = requests_for("full", hf, vocab, [("cross_entropy", [6, 11]), ("ppo", [8])], seed=1)
    check_two_adamw_steps(backend, "full", hf, params, first, second, ATOL)

    # The trained copy was the model's own: a new full model starts from the checkpoint again.
    backend.remove_model("full")
    backend.create_model("full", lora_rank=0)
    assert_dicts_equal(backend.trainable_state("full"), values_of(hf_parameters(load_hf_model(path))),
                       "a re-created full model")
    assert_zero(backend.trainable_grads("full"))


def test_lora_tenant_untouched_by_full_finetune(env) -> None:
    path, backend = env
    create_lora_with_nonzero_b(backend, "lora", rank=4, alpha=8.0, seed=1, b_seed=2)
    backend.create_model("full", lora_rank=0)
    vocab = backend.decoder_config.vocab_size
    seqs = random_sequences(vocab, [10, 5, 17], seed=3)
    inputs, targets = [s[:-1] for s in seqs], [s[1:] for s in seqs]
    lora_request = TrainRequest("lora", make_datums("cross_entropy", seqs, our_logprobs(backend, "lora", seqs), seed=4))

    def snapshot():
        return (backend.token_logprobs(inputs, targets, ["lora"] * 3), backend.token_logprobs(inputs, targets),
                backend.forward([lora_request])[0], backend.trainable_state("lora"))

    lora_lp, base_lp, lora_out, lora_state = snapshot()
    full_request = TrainRequest("full", make_datums("cross_entropy", seqs, base_lp, seed=5))
    losses = []
    for _ in range(3):
        losses.append(backend.forward_backward([full_request])[0].metrics["loss:sum"])
        backend.optim_step("full", AdamParams(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=1.0))
    assert losses[-1] < losses[0], "the full model trained"
    assert_zero(backend.trainable_grads("lora"), "LoRA grads after the full model's passes")

    lora_lp2, base_lp2, lora_out2, lora_state2 = snapshot()
    for a, b in zip(lora_lp + base_lp, lora_lp2 + base_lp2):
        assert torch.equal(a, b), "the LoRA tenant / base model changed"
    for a, b in zip(lora_out.loss_fn_outputs, lora_out2.loss_fn_outputs):
        assert torch.equal(a["logprobs"], b["logprobs"]) and torch.equal(a["elementwise_loss"], b["elementwise_loss"])
    assert_dicts_equal(lora_state2, lora_state, "LoRA weights")

    # The full model computes with its trained weights: equal to HF loaded with its trainable_state.
    trained = load_hf_model(path)
    missing, unexpected = trained.load_state_dict(backend.trainable_state("full"), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    if trained.config.tie_word_embeddings:
        assert torch.equal(trained.lm_head.weight, trained.model.embed_tokens.weight)
    full_out = backend.forward([full_request])
    assert_results_close(full_out, reference_pass(trained, [full_request], backward=False), ATOL)
    changed = max((a["logprobs"] - b).abs().max().item() for a, b in zip(full_out[0].loss_fn_outputs, base_lp))
    assert changed > 1e-3, "the full model's logprobs moved away from the base model's"
