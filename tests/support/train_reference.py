"""Plain-PyTorch references for the training tests: Tinker loss formulas, datum builders, PEFT copies, AdamW."""

from __future__ import annotations

# peft and transformers (hf_reference) are imported where a reference model is built, not here: spawned ranks import
# this module for its datums and logprobs, and peft's import (transformers, torch._dynamo) cost each ~4.5 CPU-s.

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from skyrl_tx.types import AdamParams, Datum, TrainRequest, TrainResult

# Per-loss loss_fn_config keys and their defaults (Tinker semantics).
LOSS_DEFAULTS: dict[str, dict[str, float]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    "dro": {"beta": 0.01},
}
RL_LOSSES = ("importance_sampling", "ppo", "cispo", "dro")
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


# ---- comparisons ----------------------------------------------------------------------------------
def max_diff(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    return (actual.double() - expected.double()).abs().max().item() if expected.numel() else 0.0


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float = 1e-5, what: str = "") -> None:
    """max |actual - expected| <= atol * max(1, max |expected|): absolute near 0, relative for large values."""
    actual, expected = torch.as_tensor(actual), torch.as_tensor(expected)
    scale = max(1.0, expected.double().abs().max().item()) if expected.numel() else 1.0
    diff = max_diff(actual, expected)
    assert diff <= atol * scale, f"{what}: max |diff| {diff:.3g} > {atol:g} * {scale:.3g}"


def assert_dicts_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], atol: float = 1e-5,
                       what: str = "") -> None:
    assert sorted(actual) == sorted(expected), f"{what}: names differ: {sorted(set(actual) ^ set(expected))[:8]}"
    for name in expected:
        assert actual[name].dtype == torch.float32, f"{what}: {name} is {actual[name].dtype}"
        assert_close(actual[name], expected[name], atol, f"{what} {name}")


def assert_dicts_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str = "") -> None:
    assert sorted(actual) == sorted(expected), f"{what}: names differ"
    for name in expected:
        assert torch.equal(actual[name], expected[name]), f"{what}: {name} changed"


def clone_dict(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in tensors.items()}


# ---- data -----------------------------------------------------------------------------------------
def random_sequences(vocab: int, input_lengths: Sequence[int], seed: int) -> list[list[int]]:
    """Full token sequences of input_length + 1 tokens (the datum is the sequence shifted by one)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n + 1,), generator=gen).tolist() for n in input_lengths]


def as_float(x) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.float32)


def make_datums(loss_fn: str, seqs: list[list[int]], true_logprobs: list[torch.Tensor], seed: int,
                *, as_lists: bool = False) -> list[Datum]:
    """Datums for `loss_fn` with signed random weights (some exactly 0), signed advantages and sampling
    logprobs = true logprobs + noise, with outliers of +-2 nats so that ratios exp(lp - q) fall below and above
    every clip range used in the tests (0.8/1.2, 0.9/1.1 and cispo's default high of 4).
    RL datums alternate between explicit weights and no weights (default 1)."""
    gen = torch.Generator().manual_seed(seed)
    data = []
    for i, (seq, lp) in enumerate(zip(seqs, true_logprobs)):
        n = len(seq) - 1
        assert lp.shape == (n,)
        weights = torch.randn(n, generator=gen) * 0.8 + 0.4  # mostly positive, some negative
        weights[torch.rand(n, generator=gen) < 0.15] = 0.0
        inputs: dict[str, torch.Tensor] = {"target_tokens": torch.tensor(seq[1:], dtype=torch.int64)}
        if loss_fn == "cross_entropy" or i % 2 == 0:
            inputs["weights"] = weights
        if loss_fn in RL_LOSSES:
            noise = torch.randn(n, generator=gen) * 0.35
            outliers = torch.arange(n) % 4 == (i % 4)
            noise[outliers] = torch.where(torch.arange(n)[outliers] % 8 < 4, 2.0, -2.0)
            inputs["logprobs"] = lp.detach().float() + noise
            inputs["advantages"] = torch.randn(n, generator=gen)
        if as_lists:
            inputs = {k: v.tolist() for k, v in inputs.items()}
        data.append(Datum(input_tokens=seq[:-1] if as_lists else torch.tensor(seq[:-1]), loss_fn_inputs=inputs))
    return data


def sft_datums(vocab: int, num: int, prompt_len: int, completion_len: int, seed: int) -> list[Datum]:
    """cross_entropy datums: random prompts, one shared random completion; weights 1 on the completion's targets."""
    gen = torch.Generator().manual_seed(seed)
    completion = torch.randint(0, vocab, (completion_len,), generator=gen).tolist()
    data = []
    for _ in range(num):
        seq = torch.randint(0, vocab, (prompt_len,), generator=gen).tolist() + completion
        weights = torch.zeros(len(seq) - 1)
        weights[prompt_len - 1:] = 1.0  # target i is token i+1: completion tokens start at target prompt_len-1
        data.append(Datum(input_tokens=seq[:-1], loss_fn_inputs={"target_tokens": seq[1:], "weights": weights}))
    return data


# ---- reference loss -------------------------------------------------------------------------------
def elementwise_loss(loss_fn: str, lp: torch.Tensor, inputs: dict, config: dict | None = None) -> torch.Tensor:
    """Per-token Tinker loss; differentiable in lp (float32)."""
    unknown = set(config or {}) - set(LOSS_DEFAULTS[loss_fn])
    assert not unknown, f"reference: unknown config {unknown}"
    cfg = {**LOSS_DEFAULTS[loss_fn], **(config or {})}
    w = as_float(inputs["weights"]) if "weights" in inputs else torch.ones_like(lp)
    if loss_fn == "cross_entropy":
        return -lp * w
    q, adv = as_float(inputs["logprobs"]), as_float(inputs["advantages"])
    ratio = torch.exp(lp - q)
    if loss_fn == "importance_sampling":
        return -ratio * adv * w
    if loss_fn == "ppo":
        lo, hi = cfg["clip_low_threshold"], cfg["clip_high_threshold"]
        return -torch.minimum(ratio * adv, torch.clamp(ratio, lo, hi) * adv) * w
    if loss_fn == "cispo":
        lo, hi = cfg["clip_low_threshold"], cfg["clip_high_threshold"]
        return -torch.clamp(ratio, lo, hi).detach() * lp * adv * w
    if loss_fn == "dro":
        return -(lp * adv - 0.5 * cfg["beta"] * (lp - q) ** 2) * w
    raise AssertionError(loss_fn)


def model_token_logprobs(model: torch.nn.Module, input_tokens, target_tokens) -> torch.Tensor:
    """log p(target_i | input_0..i) from a HF / PEFT model, float32, differentiable."""
    ids = torch.as_tensor(input_tokens, dtype=torch.int64)[None]
    logits = model(input_ids=ids).logits[0].float()
    targets = torch.as_tensor(target_tokens, dtype=torch.int64)
    return torch.log_softmax(logits, -1).gather(1, targets[:, None]).squeeze(1)


@torch.no_grad()
def datum_logprobs(model: torch.nn.Module, datum: Datum) -> torch.Tensor:
    return model_token_logprobs(model, datum.input_tokens, datum.loss_fn_inputs["target_tokens"])


@torch.no_grad()
def true_logprobs(model: torch.nn.Module, seqs: list[list[int]]) -> list[torch.Tensor]:
    return [model_token_logprobs(model, s[:-1], s[1:]) for s in seqs]


def reference_pass(model: torch.nn.Module, requests: list[TrainRequest], backward: bool) -> list[TrainResult]:
    """What forward(_backward) must return for requests that all use `model`; backward() accumulates into .grad
    the gradient of the plain sum of every request's elementwise loss."""
    results, total = [], None
    with torch.set_grad_enabled(backward):
        for req in requests:
            outputs, loss_sum = [], None
            for datum in req.data:
                lp = model_token_logprobs(model, datum.input_tokens, datum.loss_fn_inputs["target_tokens"])
                el = elementwise_loss(req.loss_fn, lp, datum.loss_fn_inputs, req.loss_fn_config)
                outputs.append({"logprobs": lp.detach(), "elementwise_loss": el.detach()})
                loss_sum = el.sum() if loss_sum is None else loss_sum + el.sum()
                total = el.sum() if total is None else total + el.sum()
            results.append(TrainResult(outputs, {"loss:sum": float(loss_sum.detach())}))
    if backward:
        total.backward()
    return results


def assert_results_close(actual: list[TrainResult], expected: list[TrainResult], atol: float = 1e-5) -> None:
    assert len(actual) == len(expected), "one TrainResult per request"
    for r, (got, ref) in enumerate(zip(actual, expected)):
        assert len(got.loss_fn_outputs) == len(ref.loss_fn_outputs), f"request {r}: one output per datum"
        for d, (out, ref_out) in enumerate(zip(got.loss_fn_outputs, ref.loss_fn_outputs)):
            for key in ("logprobs", "elementwise_loss"):
                assert out[key].dtype == torch.float32, f"request {r} datum {d} {key}: {out[key].dtype}"
                assert_close(out[key], ref_out[key], atol, f"request {r} datum {d} {key}")
        ref_sum = ref.metrics["loss:sum"]
        assert abs(got.metrics["loss:sum"] - ref_sum) <= atol * max(1.0, abs(ref_sum)), \
            f"request {r} loss:sum {got.metrics['loss:sum']} != {ref_sum}"


def assert_results_equal(actual: list[TrainResult], expected: list[TrainResult], atol: float = 0.0) -> None:
    """Same outputs up to atol (0: bit-identical)."""
    assert len(actual) == len(expected)
    for got, ref in zip(actual, expected):
        assert len(got.loss_fn_outputs) == len(ref.loss_fn_outputs)
        for out, ref_out in zip(got.loss_fn_outputs, ref.loss_fn_outputs):
            for key in ("logprobs", "elementwise_loss"):
                if atol == 0.0:
                    assert torch.equal(out[key], ref_out[key]), key
                else:
                    assert_close(out[key], ref_out[key], atol, key)
        assert abs(got.metrics["loss:sum"] - ref.metrics["loss:sum"]) <= atol * max(1.0, abs(ref.metrics["loss:sum"]))


# ---- PEFT / HF copies -----------------------------------------------------------------------------
def target_modules(train_attn: bool = True, train_mlp: bool = True, train_unembed: bool = True) -> list[str]:
    return (ATTN if train_attn else []) + (MLP if train_mlp else []) + (["lm_head"] if train_unembed else [])


def peft_lora_parameters(peft_model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """PEFT state-dict name ('base_model.model.<module>.lora_A.weight') → the live parameter."""
    return {name.replace(".default", ""): p for name, p in peft_model.named_parameters() if "lora_" in name}


def create_lora_with_nonzero_b(backend, model_id: str, *, rank: int, alpha: float, seed: int, b_seed: int,
                               **targets) -> dict[str, torch.Tensor]:
    """create_model + random nonzero B (so dL/dA != 0) through set_adapter_weights; returns trainable_state."""
    backend.create_model(model_id, lora_rank=rank, alpha=alpha, seed=seed, **targets)
    state = backend.trainable_state(model_id)
    gen = torch.Generator().manual_seed(b_seed)
    weights = {k: (torch.randn(v.shape, generator=gen) * 0.1 if ".lora_B." in k else v) for k, v in state.items()}
    backend.set_adapter_weights(model_id, weights)
    state = backend.trainable_state(model_id)
    assert_dicts_equal(state, weights, "trainable_state after set_adapter_weights")
    return state


def peft_copy(model_dir: Path, state: dict[str, torch.Tensor], *, rank: int, alpha: float,
              modules: list[str] | None = None) -> torch.nn.Module:
    """A PEFT model (float32) whose LoRA factors are exactly `state` (our trainable_state); names must match.
    `modules`: PEFT's target_modules (default: every linear layer, hf_reference.ALL_LINEAR)."""
    from hf_reference import ALL_LINEAR, load_hf_model
    from peft import LoraConfig, get_peft_model

    modules = ALL_LINEAR if modules is None else modules
    peft_model = get_peft_model(load_hf_model(model_dir), LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0,
                                                                     target_modules=modules))
    params = peft_lora_parameters(peft_model)
    differ = sorted(set(state) ^ set(params))
    assert not differ, f"trainable_state names != PEFT names: {differ[:8]}"
    with torch.no_grad():
        for name, param in params.items():
            assert state[name].shape == param.shape, name
            param.copy_(state[name])
    return peft_model.eval()


def hf_full_model(model_dir: Path) -> torch.nn.Module:
    """A plain HF model with every parameter trainable (full fine-tuning reference)."""
    from hf_reference import load_hf_model

    model = load_hf_model(model_dir)
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def hf_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return dict(model.named_parameters())  # tied lm_head/embed appears once, as model.embed_tokens.weight


def grads_of(params: dict[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
    return {k: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)) for k, p in params.items()}


def values_of(params: dict[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in params.items()}


# ---- optimizer --------------------------------------------------------------------------------------
def torch_adamw(params: dict[str, torch.nn.Parameter], hp: AdamParams) -> torch.optim.AdamW:
    return torch.optim.AdamW(list(params.values()), lr=hp.learning_rate, betas=(hp.beta1, hp.beta2), eps=hp.eps,
                             weight_decay=hp.weight_decay, foreach=False)


def reference_adamw_step(optimizer: torch.optim.AdamW, params: dict[str, torch.nn.Parameter],
                         grads: dict[str, torch.Tensor], hp: AdamParams) -> float:
    """clip_grad_norm_ (when grad_clip_norm > 0) then torch AdamW on `grads`; returns the pre-clip global norm."""
    assert sorted(grads) == sorted(params)
    for name, p in params.items():
        p.grad = grads[name].detach().clone()
    plist = list(params.values())
    if hp.grad_clip_norm > 0:
        norm = float(torch.nn.utils.clip_grad_norm_(plist, hp.grad_clip_norm))
    else:
        norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in plist])))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def global_norm(tensors: dict[str, torch.Tensor]) -> float:
    return float(torch.linalg.vector_norm(torch.cat([t.double().flatten() for t in tensors.values()])))


def assert_zero(tensors: dict[str, torch.Tensor], what: str = "grads") -> None:
    for name, t in tensors.items():
        assert not t.any(), f"{what}: {name} is not zero (max |x| {t.abs().max().item():.3g})"


def check_two_adamw_steps(backend, model_id: str, ref_model: torch.nn.Module, params: dict[str, torch.nn.Parameter],
                          first: list[TrainRequest], second: list[TrainRequest], atol: float = 1e-5,
                          second_atol: float | None = None) -> None:
    """Two forward_backward + optim_step rounds against the reference model and torch AdamW.

    Step 1 clips (grad_clip_norm = a quarter of the norm) with weight decay; step 2 changes the learning rate and
    does not clip, so the Adam moments mix clipped and unclipped gradients (clipping and bias correction both
    show). torch AdamW is fed OUR gradients (already compared to the reference's), so near-zero gradient entries
    cannot flip sign between implementations and turn into +-lr differences.

    second_atol (default atol): step 2 runs at weights that already differ from the reference's by up to atol x
    scale, so a deep model's step-2 results and gradients can differ by a small multiple of that."""
    optimizer = None
    first_atol = atol
    for step, (requests, lr) in enumerate([(first, 1e-2), (second, 5e-3)], start=1):
        atol = first_atol if step == 1 or second_atol is None else second_atol
        got = backend.forward_backward(requests)
        assert_results_close(got, reference_pass(ref_model, requests, backward=True), atol)
        grads = backend.trainable_grads(model_id)
        assert_dicts_close(grads, grads_of(params), atol, f"step {step} grads")
        for p in params.values():
            p.grad = None
        norm = global_norm(grads)
        assert norm > 0
        hp = AdamParams(learning_rate=lr, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                        grad_clip_norm=norm / 4 if step == 1 else 0.0)
        if optimizer is None:
            optimizer = torch_adamw(params, hp)
        optimizer.param_groups[0]["lr"] = lr
        before = backend.trainable_state(model_id)
        metrics = backend.optim_step(model_id, hp)
        ref_norm = reference_adamw_step(optimizer, params, grads, hp)
        # 1e-4: a float32 norm over ~1e5 entries (torch's own clip_grad_norm_ included) is off by ~2e-5.
        assert metrics["grad_norm"] == pytest.approx(norm, rel=1e-4), "grad_norm is the norm before clipping"
        assert metrics["grad_norm"] == pytest.approx(ref_norm, rel=1e-4)
        assert metrics["learning_rate"] == pytest.approx(lr, rel=1e-6)
        after = backend.trainable_state(model_id)
        assert_dicts_close(after, values_of(params), atol, f"step {step} weights")
        moved = max(max_diff(after[k], before[k]) for k in after)
        assert moved > 10 * atol, f"step {step} hardly moved the weights ({moved:.3g})"
        assert_zero(backend.trainable_grads(model_id), f"grads after optim_step {step}")


# Two runs of OUR implementation on the same math but different batches (split calls, other tenants in the batch,
# another slot) differ by float32 rounding of a different reduction order: a few ulps of values ~4..8 (ulp 4.8e-7).
# Measured up to ~0.9e-6 x scale, so 1e-6 sits on the noise floor; 5e-6 x scale is still ~1e4 below a real bug.
SAME_MATH_ATOL = 5e-6
# Weights after a ROBUST_ADAM step from such gradients agree far more closely (measured < 2e-8).
STEP_ATOL = 1e-6

# AdamW settings for comparing two runs of OUR optimizer whose gradients agree only to rounding (different batch
# composition or call splitting). With eps ~ 1e-12 a first Adam step is lr * sign(g), so an entry whose gradient
# is ~0 could flip sign between the runs and differ by 2 lr; clipping to norm 1 and eps = 0.1 make the update
# Lipschitz in g (|d update / d g| <= lr / eps), so rounding-level gradient differences stay rounding-level.
ROBUST_ADAM = AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=0.1, weight_decay=0.01, grad_clip_norm=1.0)


def our_logprobs(backend, model_id: str, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Logprobs of full sequences under `model_id` through forward (cross_entropy, zero weights)."""
    data = [Datum(s[:-1], {"target_tokens": s[1:], "weights": [0.0] * (len(s) - 1)}) for s in seqs]
    (result,) = backend.forward([TrainRequest(model_id, data)])
    return [out["logprobs"] for out in result.loss_fn_outputs]
