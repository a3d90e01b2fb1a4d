"""gspo and stable_reinforce: outputs and LoRA gradients equal plain PyTorch formulas on a PEFT copy of the adapter."""

from __future__ import annotations

import pytest
import torch
from train_reference import (
    assert_dicts_close,
    assert_results_close,
    assert_results_equal,
    create_lora_with_nonzero_b,
    grads_of,
    make_datums,
    model_token_logprobs,
    peft_copy,
    peft_lora_parameters,
    random_sequences,
    reference_pass,
    true_logprobs,
)

from skyrl_tx.backend.native import NativeBackend
from skyrl_tx.config import BackendSettings
from skyrl_tx.errors import InvalidArgumentError
from skyrl_tx.types import Datum, TrainRequest, TrainResult

RANK, ALPHA = 4, 8.0
ATOL = 1e-5
LENGTHS = [7, 1, 16, 11, 9]
# Per datum, q = true logprobs + noise + offset: the mean log-ratio S is about -offset, so the sequence ratios
# exp(S) fall below, inside and above the clip ranges used here (0.8/1.2 and 0.9/1.1).
OFFSETS = [0.6, 0.0, -0.6, 0.15, -0.15]
# Defaults this server implements (csrc/loss/losses.cpp documents the sources).
DEFAULTS = {"gspo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, "stable_reinforce": {"kl_coeff": 0.01}}
CASES = [
    ("gspo", None, True),
    ("gspo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, True),
    ("gspo", None, False),  # no sequence_ratio_mask: the ratio averages over tokens with A != 0 and w != 0
    ("stable_reinforce", None, False),
    ("stable_reinforce", {"kl_coeff": 0.5}, False),
]
# Default settings; and tiny logits chunks + micro-batches + checkpointing, so a gspo datum spans several head
# chunks (its sequence ratio must still be the whole datum's) and the micro-batch runner's other path runs.
SETTINGS = {
    "default": {},
    "chunked": {"logprobs_chunk_tokens": 5, "train_micro_batch_tokens": 24, "gradient_checkpointing": True},
}


# ---- reference ----------------------------------------------------------------------------------------------
def ratio_mask(inputs: dict) -> torch.Tensor:
    """The tokens M of gspo's sequence ratio: sequence_ratio_mask != 0, else A != 0 and w != 0."""
    if "sequence_ratio_mask" in inputs:
        return torch.as_tensor(inputs["sequence_ratio_mask"]) != 0
    adv = torch.as_tensor(inputs["advantages"], dtype=torch.float32)
    w = torch.as_tensor(inputs.get("weights", torch.ones_like(adv)), dtype=torch.float32)
    return (adv != 0) & (w != 0)


def reference_loss(loss_fn: str, lp: torch.Tensor, inputs: dict, config: dict | None) -> torch.Tensor:
    """Per-token loss of one datum (differentiable in lp), written from the formulas, not the implementation."""
    cfg = {**DEFAULTS[loss_fn], **(config or {})}
    q = torch.as_tensor(inputs["logprobs"], dtype=torch.float32)
    adv = torch.as_tensor(inputs["advantages"], dtype=torch.float32)
    w = torch.as_tensor(inputs["weights"], dtype=torch.float32) if "weights" in inputs else torch.ones_like(lp)
    if loss_fn == "gspo":
        # Tinker docs: log_ratio = (lp.detach() - q)[mask].mean(); ratio = exp(log_ratio + lp - lp.detach())
        in_ratio = ratio_mask(inputs)
        log_ratio = (lp.detach() - q)[in_ratio].mean() if in_ratio.any() else torch.tensor(0.0)
        ratio = torch.exp(log_ratio + lp - lp.detach())
        clipped = torch.clamp(ratio, cfg["clip_low_threshold"], cfg["clip_high_threshold"])
        return -torch.minimum(ratio * adv, clipped * adv) * w
    if loss_fn == "stable_reinforce":
        log_r = lp - q
        return (-adv * lp + cfg["kl_coeff"] * (torch.exp(log_r) - 1 - log_r)) * w
    raise AssertionError(loss_fn)


def reference_new_losses(model: torch.nn.Module, requests: list[TrainRequest], backward: bool) -> list[TrainResult]:
    """What forward(_backward) must return; backward() accumulates the gradient of the plain sum into .grad."""
    results, total = [], None
    with torch.set_grad_enabled(backward):
        for req in requests:
            outputs, loss_sum = [], 0.0
            for datum in req.data:
                lp = model_token_logprobs(model, datum.input_tokens, datum.loss_fn_inputs["target_tokens"])
                el = reference_loss(req.loss_fn, lp, datum.loss_fn_inputs, req.loss_fn_config)
                outputs.append({"logprobs": lp.detach(), "elementwise_loss": el.detach()})
                loss_sum += float(el.sum().detach())
                total = el.sum() if total is None else total + el.sum()
            results.append(TrainResult(outputs, {"loss:sum": loss_sum}))
    if backward:
        total.backward()
    return results


# ---- data -----------------------------------------------------------------------------------------------------
def new_loss_datums(loss_fn: str, seqs: list[list[int]], lps: list[torch.Tensor], seed: int,
                    with_mask: bool) -> list[Datum]:
    """RL datums: a prompt part (A = 0, outside the ratio mask) then a completion with signed advantages, signed
    weights (some 0) on every other datum, q = true logprobs + noise + a per-datum offset."""
    gen = torch.Generator().manual_seed(seed)
    data = []
    for i, (seq, lp) in enumerate(zip(seqs, lps)):
        n = len(seq) - 1
        prompt = n // 3
        adv = torch.randn(n, generator=gen)
        adv[:prompt] = 0.0
        inputs: dict = {"target_tokens": torch.tensor(seq[1:], dtype=torch.int64),
                        "logprobs": lp.float() + torch.randn(n, generator=gen) * 0.2 + OFFSETS[i % len(OFFSETS)],
                        "advantages": adv}
        if i % 2 == 0:
            weights = torch.randn(n, generator=gen) * 0.8 + 0.4
            weights[torch.rand(n, generator=gen) < 0.15] = 0.0
            inputs["weights"] = weights
        if with_mask:
            mask = torch.ones(n)
            mask[:prompt] = 0.0
            inputs["sequence_ratio_mask"] = mask
        data.append(Datum(torch.tensor(seq[:-1]), inputs))
    return data


def request_for(model_id: str, peft_model, vocab: int, loss_fn: str, config, with_mask: bool, lengths,
                seed: int) -> TrainRequest:
    seqs = random_sequences(vocab, lengths, seed)
    data = new_loss_datums(loss_fn, seqs, true_logprobs(peft_model, seqs), seed + 100, with_mask)
    return TrainRequest(model_id, data, loss_fn, config)


def sequence_ratios(peft_model, request: TrainRequest) -> torch.Tensor:
    out = []
    for d in request.data:
        lp = model_token_logprobs(peft_model, d.input_tokens, d.loss_fn_inputs["target_tokens"]).detach()
        m = ratio_mask(d.loss_fn_inputs)
        if m.any():
            out.append(torch.exp((lp - torch.as_tensor(d.loss_fn_inputs["logprobs"]))[m].mean()))
    return torch.stack(out)


# ---- fixtures -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=[(p, s) for p in ("tiny-qwen3", "tiny-llama3") for s in SETTINGS],
                ids=lambda p: f"{p[0]}-{p[1]}")
def env(request: pytest.FixtureRequest, tiny_model_dir):
    preset, settings = request.param
    path = tiny_model_dir(preset)
    return path, NativeBackend(path, BackendSettings(max_lora_adapters=2, max_lora_rank=8, **SETTINGS[settings]))


@pytest.fixture
def lora(env):
    path, backend = env
    state = create_lora_with_nonzero_b(backend, "lora", rank=RANK, alpha=ALPHA, seed=11, b_seed=12)
    try:
        yield backend, "lora", peft_copy(path, state, rank=RANK, alpha=ALPHA)
    finally:
        backend.remove_model("lora")


# ---- tests ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("loss_fn,config,with_mask", CASES,
                         ids=[f"{fn}-{'custom' if c else 'default'}-{'mask' if m else 'nomask'}" for fn, c, m in CASES])
def test_new_loss_matches_reference(lora, loss_fn: str, config, with_mask: bool) -> None:
    backend, model_id, peft_model = lora
    request = request_for(model_id, peft_model, backend.decoder_config.vocab_size, loss_fn, config, with_mask,
                          LENGTHS, seed=7)
    if loss_fn == "gspo":  # whole datums clipped on both sides, and some not clipped
        cfg = {**DEFAULTS["gspo"], **(config or {})}
        ratios = sequence_ratios(peft_model, request)
        assert (ratios < cfg["clip_low_threshold"]).any() and (ratios > cfg["clip_high_threshold"]).any()
        assert ((ratios >= cfg["clip_low_threshold"]) & (ratios <= cfg["clip_high_threshold"])).any()

    got = backend.forward_backward([request])
    expected = reference_new_losses(peft_model, [request], backward=True)
    assert_results_close(got, expected, ATOL)
    ref_grads = grads_of(peft_lora_parameters(peft_model))
    assert all(g.abs().max() > 0 for g in ref_grads.values()), "every A and B gets a gradient in this setup"
    assert_dicts_close(backend.trainable_grads(model_id), ref_grads, ATOL, f"{loss_fn} grads")

    # forward (which reuses the gspo pre-pass logprobs): the same outputs, and the gradients stay as they were.
    assert_results_close(backend.forward([request]), expected, ATOL)
    assert_dicts_close(backend.trainable_grads(model_id), ref_grads, ATOL, f"{loss_fn} grads after forward")


def test_mixed_with_token_losses_in_one_call(lora) -> None:
    """gspo and stable_reinforce beside ppo/cross_entropy requests in one call (shared micro-batches): per-request
    outputs as the references, gradient = gradient of the plain sum of all of them."""
    backend, model_id, peft_model = lora
    vocab = backend.decoder_config.vocab_size
    new = [request_for(model_id, peft_model, vocab, "gspo", None, True, [12, 4, 9], seed=20),
           request_for(model_id, peft_model, vocab, "stable_reinforce", {"kl_coeff": 0.2}, False, [6, 13], seed=21),
           request_for(model_id, peft_model, vocab, "gspo", {"clip_high_threshold": 1.1}, False, [3, 15], seed=22)]
    old = []
    for i, loss_fn in enumerate(("ppo", "cross_entropy")):
        seqs = random_sequences(vocab, [8, 5], seed=30 + i)
        old.append(TrainRequest(model_id, make_datums(loss_fn, seqs, true_logprobs(peft_model, seqs), seed=40 + i),
                                loss_fn))
    requests = [new[0], old[0], new[1], old[1], new[2]]

    got = backend.forward_backward(requests)
    expected_old = reference_pass(peft_model, old, backward=True)
    expected_new = reference_new_losses(peft_model, new, backward=True)
    assert_results_close(got, [expected_new[0], expected_old[0], expected_new[1], expected_old[1], expected_new[2]],
                         ATOL)
    assert_dicts_close(backend.trainable_grads(model_id), grads_of(peft_lora_parameters(peft_model)), ATOL,
                       "mixed-batch grads")


def test_gspo_datum_ratio_ignores_its_batch_neighbours(lora) -> None:
    """A gspo datum's outputs do not depend on which other datums share its call (the ratio is per datum)."""
    backend, model_id, peft_model = lora
    vocab = backend.decoder_config.vocab_size
    both = request_for(model_id, peft_model, vocab, "gspo", None, True, [10, 14], seed=50)
    alone = [TrainRequest(model_id, [d], "gspo") for d in both.data]
    together = backend.forward([both])[0]
    apart = [backend.forward([r])[0] for r in alone]
    for i, result in enumerate(apart):
        assert_results_equal([TrainResult([together.loss_fn_outputs[i]], {"loss:sum": 0.0})],
                             [TrainResult(result.loss_fn_outputs, {"loss:sum": 0.0})], atol=1e-6)


@pytest.mark.parametrize("loss_fn,key", [("gspo", "advantages"), ("gspo", "logprobs"),
                                         ("stable_reinforce", "advantages"), ("stable_reinforce", "logprobs")])
def test_missing_required_input_is_named(env, loss_fn: str, key: str) -> None:
    _, backend = env
    backend.create_model("errors", lora_rank=RANK, alpha=ALPHA, seed=0)
    try:
        seqs = random_sequences(backend.decoder_config.vocab_size, [5, 8], 3)
        data = new_loss_datums(loss_fn, seqs, [torch.full((len(s) - 1,), -7.0) for s in seqs], 3, loss_fn == "gspo")
        data[1] = Datum(data[1].input_tokens, {k: v for k, v in data[1].loss_fn_inputs.items() if k != key})
        for call in (backend.forward, backend.forward_backward):
            with pytest.raises(InvalidArgumentError, match=f"loss_fn_inputs\\['{key}'\\]"):
                call([TrainRequest("errors", data, loss_fn)])
    finally:
        backend.remove_model("errors")


@pytest.mark.parametrize("loss_fn,config,match", [
    ("stable_reinforce", {"beta": 0.1}, "beta"),          # dro's key, not stable_reinforce's
    ("stable_reinforce", {"kl_coeff": -0.1}, "kl_coeff"),
    ("gspo", {"kl_coeff": 0.1}, "kl_coeff"),
    ("gspo", {"clip_low_threshold": 1.3}, "clip_low_threshold"),
])
def test_bad_config_is_named(env, loss_fn: str, config, match: str) -> None:
    _, backend = env
    backend.create_model("errors", lora_rank=RANK, alpha=ALPHA, seed=0)
    try:
        seqs = random_sequences(backend.decoder_config.vocab_size, [5], 4)
        data = new_loss_datums(loss_fn, seqs, [torch.full((5,), -7.0)], 4, False)
        with pytest.raises(InvalidArgumentError, match=match):
            backend.forward_backward([TrainRequest("errors", data, loss_fn, config)])
    finally:
        backend.remove_model("errors")
