"""MoE presets (tiny-qwen3-moe, tiny-deepseek-v3, tiny-qwen3.5-moe) beyond the shared parity tests
(test_architecture_parity.py): layouts, expert adapters, router and expert gradients of full fine-tuning, exports,
checkpointing, bf16 and DeepSeek's router bias, against Hugging Face transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from backend_parity import ALPHA, RANK, ours, random_adapter, seqs_of
from hf_reference import hf_token_logprobs, load_hf_model
from moe_reference import MergedLoraModel, expert_factor_names, merged_parameters
from train_reference import (
    assert_close,
    assert_dicts_close,
    grads_of,
    hf_full_model,
    hf_parameters,
    make_datums,
    random_sequences,
    reference_pass,
    true_logprobs,
)

from skyrl_tx.backend.native import NativeBackend
from skyrl_tx.config import BackendSettings
from skyrl_tx.types import AdamParams, Datum, TrainRequest

PRESETS = ["tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-qwen3.5-moe"]
# Which layers are MoE: a dense first layer (mlp_only_layers, first_k_dense_replace) or every layer (Qwen3.5 MoE).
MLP_KINDS = {"tiny-qwen3-moe": ["dense", "moe", "moe"], "tiny-deepseek-v3": ["dense", "moe", "moe"],
             "tiny-qwen3.5-moe": ["moe"] * 4}
ATOL = 1e-5


@pytest.fixture(scope="module", params=PRESETS)
def preset(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def path(preset: str, tiny_model_dir) -> Path:
    return tiny_model_dir(preset)


@torch.no_grad()
def merged_logprobs(hf: torch.nn.Module, state: dict[str, torch.Tensor], scale: float, seq: list[int]):
    return hf_token_logprobs(MergedLoraModel(hf, state, scale), seq)


def test_layout_and_config(backend: NativeBackend, hf: torch.nn.Module, preset: str) -> None:
    cfg = backend.decoder_config
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob) == (8, 2, True)
    if cfg.architecture == "DeepseekV3ForCausalLM":
        assert (cfg.scoring_func, cfg.n_group, cfg.topk_group, cfg.n_shared_experts, cfg.rope_scaling.type) == \
            ("sigmoid", 4, 2, 1, "yarn")
    if cfg.architecture == "Qwen3_5MoeForCausalLM":
        assert cfg.shared_expert_intermediate_size == 64 and cfg.layer_types[1] == "full_attention"
    kinds = ["moe" if hasattr(layer.mlp, "experts") else "dense" for layer in hf.model.layers]
    assert kinds == MLP_KINDS[preset]


def test_adapter_covers_every_expert_but_not_the_router(backend: NativeBackend, preset: str) -> None:
    """Which modules an adapter has (what it computes is checked in test_architecture_parity.py)."""
    state = random_adapter(backend, "names", seed=3)
    try:
        # One adapter per expert per projection (8 experts x 3 x each MoE layer, A and B each).
        assert len(expert_factor_names(state)) == 8 * 3 * MLP_KINDS[preset].count("moe") * 2
        assert not [k for k in state if ".mlp.gate." in k], "the router is not LoRA-adapted"
    finally:
        backend.remove_model("names")


def test_full_finetune_router_and_expert_gradients_equal_transformers(backend: NativeBackend, path: Path) -> None:
    """lora_rank=0: the router (mlp.gate.weight) and every expert weight are trained; names are the checkpoint's."""
    backend.create_model("full", lora_rank=0)
    try:
        hf = hf_full_model(path)
        state = backend.trainable_state("full")
        assert "model.layers.1.mlp.gate.weight" in state and "model.layers.2.mlp.experts.7.down_proj.weight" in state
        vocab = backend.decoder_config.vocab_size
        seqs = random_sequences(vocab, [9, 13], 50)
        request = [TrainRequest("full", make_datums("cross_entropy", seqs, true_logprobs(hf, seqs), 51))]
        backend.forward_backward(request)
        reference_pass(hf, request, backward=True)
        grads = backend.trainable_grads("full")
        # HF's fused expert gradients, split per expert under the checkpoint's names.
        per_name = {}
        for name, g in grads_of(hf_parameters(hf)).items():
            if name.endswith("experts.gate_up_proj"):
                inter = g.shape[1] // 2
                for e in range(g.shape[0]):
                    per_name[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = g[e, :inter]
                    per_name[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = g[e, inter:]
            elif name.endswith("experts.down_proj"):
                for e in range(g.shape[0]):
                    per_name[name.replace("down_proj", f"{e}.down_proj.weight")] = g[e]
            else:
                per_name[name] = g
        assert grads["model.layers.1.mlp.gate.weight"].abs().max() > 0, "the router gets a gradient"
        # DeepSeek's e_score_correction_bias: a buffer in transformers; ours lists it (so copies carry it), grad 0.
        for name in [k for k in grads if k.endswith("e_score_correction_bias")]:
            assert not grads.pop(name).any(), name
        assert_dicts_close(grads, per_name, ATOL, "full fine-tuning grads")
    finally:
        backend.remove_model("full")


def test_merged_reference_is_not_the_base(hf: torch.nn.Module) -> None:
    """The reference itself: an all-zero delta leaves every weight unchanged; a nonzero one changes fused rows."""
    name = "model.layers.1.mlp.experts.3.up_proj"
    delta = torch.ones(32, 64)
    merged = merged_parameters(hf, {name: delta})
    fused = dict(hf.named_parameters())["model.layers.1.mlp.experts.gate_up_proj"]
    diff = merged["model.layers.1.mlp.experts.gate_up_proj"] - fused
    assert torch.allclose(diff[3, 32:], delta) and not diff[3, :32].any() and not diff[:3].any()



def test_merged_export_with_expert_adapters_loads_in_transformers(backend: NativeBackend, tmp_path: Path) -> None:
    """The PEFT-layout adapter (per-expert names) merges into the checkpoint's per-expert weights; transformers
    loads the merged directory and gives our adapter's logprobs."""
    from skyrl_tx.checkpoints.formats import ModelMeta, adapter_files, write_directory
    from skyrl_tx.checkpoints.merge import merge_adapter

    random_adapter(backend, "export", seed=61)
    try:
        (tmp_path / "adapter").mkdir()
        write_directory(tmp_path / "adapter", adapter_files(ModelMeta(str(backend.model_dir), RANK, ALPHA),
                                                            backend.adapter_state_dict("export")))
        merged = merge_adapter(backend.model_dir, tmp_path / "adapter", tmp_path / "merged")
        assert "model.layers.2.mlp.experts.7.down_proj" in merged
        seq = seqs_of(backend.decoder_config.vocab_size, [40], seed=62)[0]
        (got,) = ours(backend, [seq], ["export"])
        assert_close(got, hf_token_logprobs(load_hf_model(tmp_path / "merged"), seq), ATOL)
    finally:
        backend.remove_model("export")


@pytest.mark.parametrize("train_mlp", [True, False])
def test_adapter_export_loads_in_peft(backend: NativeBackend, tmp_path: Path, train_mlp: bool) -> None:
    """The PEFT directory loads in PEFT 0.21 on transformers 5 and equals ours. With expert adapters PEFT fuses the
    saved per-expert factors into its LoRA of the fused 3-D experts (target_parameters mlp.experts.gate_up_proj /
    down_proj, rank and alpha doubled on gate_up_proj), and the MLPs that are plain linears (the dense first layer,
    shared experts) keep their adapters as target_parameters (as target_modules, PEFT's conversion would move them
    to the experts: 0.4 to 1.2 off on these presets). Our load_peft_adapter reads the directory back to the same
    model."""
    import json

    from peft import PeftModel

    from skyrl_tx.checkpoints.formats import ModelMeta, adapter_files, write_directory

    random_adapter(backend, "peft", seed=71, train_mlp=train_mlp)
    try:
        write_directory(tmp_path, adapter_files(ModelMeta(str(backend.model_dir), RANK, ALPHA, train_mlp=train_mlp),
                                                backend.adapter_state_dict("peft")))
        config = json.loads((tmp_path / "adapter_config.json").read_text())
        if train_mlp:
            assert not set(config["target_modules"]) & {"gate_proj", "up_proj", "down_proj"}, config
            assert {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"} <= set(config["target_parameters"])
        seq = seqs_of(backend.decoder_config.vocab_size, [30], seed=72)[0]
        (got,) = ours(backend, [seq], ["peft"])
        peft = PeftModel.from_pretrained(load_hf_model(backend.model_dir), tmp_path)
        assert_close(got, hf_token_logprobs(peft, seq), ATOL)
        backend.load_peft_adapter("reloaded", tmp_path)
        (again,) = ours(backend, [seq], ["reloaded"])
        assert_close(again, got, 0.0)
    finally:
        for model_id in ("peft", "reloaded"):
            try:
                backend.remove_model(model_id)
            except Exception:  # noqa: BLE001 - "reloaded" is not created when an assertion before it fails
                pass


def test_gradient_checkpointing_and_micro_batches_give_the_same_gradients(path: Path,
                                                                          backend: NativeBackend) -> None:
    """Recomputed layers route again to the same experts: checkpointed, micro-batched training equals one pass."""
    other = NativeBackend(path, BackendSettings(max_lora_adapters=1, max_lora_rank=8, gradient_checkpointing=True,
                                                train_micro_batch_tokens=16))
    vocab = backend.decoder_config.vocab_size
    seqs = random_sequences(vocab, [9, 14, 5], 80)
    grads = []
    for b in (backend, other):
        state = random_adapter(b, "ckpt", seed=81)
        try:
            data = make_datums("cross_entropy", seqs, true_logprobs(MergedLoraModel(load_hf_model(path), state,
                                                                                    ALPHA / RANK), seqs), 82)
            b.forward_backward([TrainRequest("ckpt", data)])
            grads.append(b.trainable_grads("ckpt"))
        finally:
            b.remove_model("ckpt")
    assert_dicts_close(grads[1], grads[0], 5e-6, "checkpointed vs plain")


def test_bfloat16_compute_tracks_float32(path: Path, backend: NativeBackend) -> None:
    bf16 = NativeBackend(path, BackendSettings(dtype="bfloat16"))
    seq = seqs_of(backend.decoder_config.vocab_size, [20], seed=90)[0]
    (got,), (ref,) = ours(bf16, [seq]), ours(backend, [seq])
    assert got.dtype == torch.float32
    # bf16 has ~3 significant digits; near-tied routing choices may flip, so the bound is loose (logprobs ~ -7.7).
    assert_close(got, ref, 0.02)


def test_full_finetune_steps_leave_the_router_score_bias_alone(backend: NativeBackend) -> None:
    """DeepSeek V3's e_score_correction_bias is a buffer (transformers adjusts it outside the gradient step): a full
    fine-tune carries and saves it, and AdamW with weight decay moves the weights but never it."""
    backend.create_model("full-wd", lora_rank=0)
    try:
        before = backend.trainable_state("full-wd")
        biases = [k for k in before if k.endswith(".gate.e_score_correction_bias")]
        vocab = backend.decoder_config.vocab_size
        seqs = seqs_of(vocab, [7, 5], 61)
        data = [Datum(s[:-1], {"target_tokens": s[1:], "weights": [1.0] * (len(s) - 1)}) for s in seqs]
        backend.forward_backward([TrainRequest("full-wd", data)])
        backend.optim_step("full-wd", AdamParams(learning_rate=1e-2, weight_decay=0.5))
        after = backend.trainable_state("full-wd")
        moved = [k for k in before if not torch.equal(before[k], after[k])]
        assert moved, "the step changed nothing"
        assert not [k for k in moved if k in biases], moved
        if "deepseek" in str(backend.model_dir):  # nonzero, so weight decay would have moved them
            assert biases and all(before[k].abs().max() > 0 for k in biases), sorted(before)[:10]
    finally:
        backend.remove_model("full-wd")
