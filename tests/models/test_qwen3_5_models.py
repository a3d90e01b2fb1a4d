"""tiny-qwen3.5 (Gated DeltaNet + gated attention) beyond the shared parity tests (test_architecture_parity.py):
layout, the DeltaNet's LoRA modules, full fine-tuning gradients, PEFT and merged exports, the hub's vision-language
checkpoint layout and config defaults, against Hugging Face transformers' Qwen3_5ForCausalLM."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from backend_parity import ALPHA, RANK, ours, random_adapter, seqs_of
from hf_reference import hf_token_logprobs, load_hf_model
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
from skyrl_tx.types import TrainRequest

ATOL = 1e-5
DELTANET_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")


@pytest.fixture(scope="module")
def path(tiny_model_dir) -> Path:
    return tiny_model_dir("tiny-qwen3.5")


def test_hybrid_layout_and_config(backend: NativeBackend, hf: torch.nn.Module) -> None:
    cfg = backend.decoder_config
    assert cfg.layer_types == ("linear_attention", "full_attention", "linear_attention", "linear_attention")
    assert (cfg.partial_rotary_factor, cfg.linear_num_key_heads, cfg.linear_num_value_heads) == (0.25, 2, 4)
    assert [layer.block_type for layer in hf.model.layers] == list(cfg.layer_types)


def test_adapter_covers_every_projection(backend: NativeBackend) -> None:
    """The DeltaNet's five projections are LoRA modules beside attention and MLP ones (what the adapter computes is
    checked in test_architecture_parity.py)."""
    state = random_adapter(backend, "names", seed=3)
    try:
        deltanet = {k.split(".linear_attn.")[1].split(".lora_")[0] for k in state if ".linear_attn." in k}
        assert deltanet == set(DELTANET_PROJECTIONS)
        assert sum(".linear_attn." in k for k in state) == 3 * len(DELTANET_PROJECTIONS) * 2  # 3 layers, A and B
        assert any(".self_attn.q_proj." in k for k in state) and any(".mlp.down_proj." in k for k in state)
    finally:
        backend.remove_model("names")


def test_full_finetune_gradients_equal_transformers(backend: NativeBackend, path: Path) -> None:
    """lora_rank=0: every weight trains, the DeltaNet's conv, decay (A_log, dt_bias) and gated norm included."""
    backend.create_model("full", lora_rank=0)
    try:
        hf = hf_full_model(path)
        state = backend.trainable_state("full")
        for name in ("conv1d.weight", "A_log", "dt_bias", "norm.weight"):
            assert f"model.layers.0.linear_attn.{name}" in state, name
        seqs = random_sequences(backend.decoder_config.vocab_size, [9, 70], 50)
        request = [TrainRequest("full", make_datums("cross_entropy", seqs, true_logprobs(hf, seqs), 51))]
        backend.forward_backward(request)
        reference_pass(hf, request, backward=True)
        grads = backend.trainable_grads("full")
        assert grads["model.layers.0.linear_attn.A_log"].abs().max() > 0
        assert_dicts_close(grads, grads_of(hf_parameters(hf)), ATOL, "full fine-tuning grads")
    finally:
        backend.remove_model("full")


def test_adapter_export_loads_in_peft_and_merges(backend: NativeBackend, tmp_path: Path) -> None:
    """Our PEFT directory (DeltaNet projections among its target modules) loads in PEFT on transformers and equals
    ours; merged into the base weights it loads as a plain transformers checkpoint with the same logprobs."""
    from peft import PeftModel

    from skyrl_tx.checkpoints.formats import ModelMeta, adapter_files, write_directory
    from skyrl_tx.checkpoints.merge import merge_adapter

    random_adapter(backend, "export", seed=71)
    try:
        (tmp_path / "adapter").mkdir()
        write_directory(tmp_path / "adapter", adapter_files(ModelMeta(str(backend.model_dir), RANK, ALPHA),
                                                            backend.adapter_state_dict("export")))
        seq = seqs_of(backend.decoder_config.vocab_size, [70], seed=72)[0]
        (got,) = ours(backend, [seq], ["export"])
        peft = PeftModel.from_pretrained(load_hf_model(backend.model_dir), tmp_path / "adapter")
        assert_close(got, hf_token_logprobs(peft, seq), ATOL)
        merge_adapter(backend.model_dir, tmp_path / "adapter", tmp_path / "merged")
        assert_close(got, hf_token_logprobs(load_hf_model(tmp_path / "merged"), seq), ATOL)
    finally:
        backend.remove_model("export")


def test_vision_language_checkpoint_serves_its_text_model(path: Path, backend: NativeBackend,
                                                          tmp_path: Path) -> None:
    """The hub's Qwen3.5 layout: Qwen3_5ForConditionalGeneration with the text config nested in text_config,
    weights under model.language_model, a vision tower and an MTP head beside them. The text model loads from it
    and gives the same logprobs."""
    import json

    from safetensors.torch import load_file, save_file

    text = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "tie_word_embeddings": False,
        "text_config": {**text, "model_type": "qwen3_5_text"}, "vision_config": {"model_type": "qwen3_5_vision"}}))
    weights = {("lm_head.weight" if k == "lm_head.weight" else k.replace("model.", "model.language_model.", 1)): v
               for k, v in load_file(path / "model.safetensors").items()}
    weights["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    weights["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file(weights, tmp_path / "model.safetensors")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((path / name).read_bytes())
    vl = NativeBackend(tmp_path, BackendSettings(max_lora_adapters=1, max_lora_rank=8))
    assert vl.decoder_config == backend.decoder_config
    seqs = seqs_of(backend.decoder_config.vocab_size, [9, 70], seed=80)
    for got, expected in zip(ours(vl, seqs), ours(backend, seqs)):
        assert_close(got, expected, 0.0)


@pytest.mark.parametrize("preset", ["tiny-qwen3.5", "tiny-qwen3.5-moe"])
def test_vision_language_checkpoint_exports_under_its_own_names(preset: str, tiny_model_dir, tmp_path: Path) -> None:
    """A model trained on the hub's layout (Qwen3_5(Moe)ForConditionalGeneration as transformers writes it: the text
    model under model.language_model, a vision tower beside it) exports as that checkpoint names it: PEFT on the
    vision-language class loads the adapter to our logprobs (named model.layers.*, as before, PEFT adapted only
    lm_head: 0.66 off; the MoE's expert factors per expert, PEFT drops them there: 0.71 off, so they are written
    fused), load_peft_adapter and read_weights read it back, and the merged export is the whole vision-language
    checkpoint again (vision tower included), which transformers loads to the same logprobs."""
    import json

    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import (
        AutoModelForImageTextToText,
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5MoeConfig,
        Qwen3_5MoeForConditionalGeneration,
    )

    from skyrl_tx.checkpoints.formats import ModelMeta, adapter_files, read_weights, write_directory
    from skyrl_tx.checkpoints.merge import merge_adapter

    text_dir = tiny_model_dir(preset)
    text = json.loads((text_dir / "config.json").read_text())
    moe = "num_experts" in text
    config_cls, model_cls = ((Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration) if moe else
                             (Qwen3_5Config, Qwen3_5ForConditionalGeneration))
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "patch_size": 4,
              "out_hidden_size": text["hidden_size"], "num_position_embeddings": 16}
    text_config = {**text, "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text"}
    vl = model_cls(config_cls(text_config=text_config, vision_config=vision, tie_word_embeddings=False))
    weights = {(k if k.startswith("lm_head.") else k.replace("model.", "model.language_model.", 1)): v
               for k, v in load_hf_model(text_dir).state_dict().items()}
    missing, unexpected = vl.load_state_dict(weights, strict=False)
    assert not unexpected and all(k.startswith("model.visual.") for k in missing)
    vl_dir = tmp_path / "vl"
    vl.save_pretrained(vl_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (vl_dir / name).write_bytes((text_dir / name).read_bytes())

    ours_vl = NativeBackend(vl_dir, BackendSettings(max_lora_adapters=2, max_lora_rank=8))
    random_adapter(ours_vl, "export", seed=91)
    state = ours_vl.adapter_state_dict("export")
    vl_names = ("base_model.model.model.language_model.layers.", "base_model.model.lm_head.")
    assert all(k.startswith(vl_names) for k in state), sorted(state)[:4]
    meta = ModelMeta(str(vl_dir), RANK, ALPHA)
    write_directory(tmp_path, adapter_files(meta, state))
    saved = load_file(tmp_path / "adapter_model.safetensors")
    assert any(k.endswith(".mlp.experts.base_layer.lora_A.weight") for k in saved) == moe
    read_back = read_weights(lambda name: (tmp_path / name).read_bytes(), meta)
    assert sorted(read_back) == sorted(state) and all(torch.equal(read_back[k], state[k]) for k in state)
    seq = seqs_of(ours_vl.decoder_config.vocab_size, [40], seed=92)[0]
    (got,) = ours(ours_vl, [seq], ["export"])

    def hf_vl(model_dir: Path) -> torch.nn.Module:
        return AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32,
                                                           attn_implementation="eager").eval()

    assert_close(got, hf_token_logprobs(PeftModel.from_pretrained(hf_vl(vl_dir), tmp_path), seq), ATOL)
    ours_vl.load_peft_adapter("reloaded", tmp_path)
    assert_close(ours(ours_vl, [seq], ["reloaded"])[0], got, 0.0)
    merge_adapter(vl_dir, tmp_path, tmp_path / "merged")
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    base = load_file(vl_dir / "model.safetensors")
    assert sorted(merged) == sorted(base)
    assert all(torch.equal(merged[k], base[k]) for k in base if k.startswith("model.visual."))
    assert_close(got, hf_token_logprobs(hf_vl(tmp_path / "merged"), seq), ATOL)


def test_qwen3_5_config_defaults_follow_transformers() -> None:
    """Without layer_types or partial_rotary_factor, Qwen3_5TextConfig's rules: a full-attention layer every
    full_attention_interval (4) layers and RoPE on a quarter of head_dim."""
    from transformers import Qwen3_5TextConfig

    from skyrl_tx.models.hf_config import decoder_config_from_dict

    raw = {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "vocab_size": 64,
           "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 8, "num_attention_heads": 2,
           "num_key_value_heads": 1, "head_dim": 8, "linear_num_key_heads": 1, "linear_num_value_heads": 2,
           "linear_key_head_dim": 4, "linear_value_head_dim": 4, "linear_conv_kernel_dim": 4}
    ours_cfg = decoder_config_from_dict(raw)
    theirs = Qwen3_5TextConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    assert list(ours_cfg.layer_types) == theirs.layer_types
    assert ours_cfg.partial_rotary_factor == theirs.rope_parameters["partial_rotary_factor"] == 0.25


def test_unknown_layer_type_is_a_clear_error(path: Path) -> None:
    from skyrl_tx.backend.native import _native_model_config
    from skyrl_tx.errors import UnimplementedError
    from skyrl_tx.models.hf_config import load_decoder_config

    native = _native_model_config(load_decoder_config(path))
    assert native.mixer_layout() == ["gated_deltanet", "attention", "gated_deltanet", "gated_deltanet"]
    native.layer_types = ["linear_attention", "sliding_attention", "linear_attention", "linear_attention"]
    with pytest.raises(UnimplementedError, match=r"layer_types\[1\] = 'sliding_attention' is not supported"):
        native.validate()
