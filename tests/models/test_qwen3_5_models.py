"""tiny-qwen3.5 (Gated DeltaNet + gated attention): logprobs, LoRA on every projection (the DeltaNet's in/out
projections included), gradients and AdamW equal Hugging Face transformers' Qwen3_5ForCausalLM."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from hf_reference import hf_token_logprobs, load_hf_model
from moe_reference import MergedLoraModel, merge_into
from train_reference import (
    assert_close,
    assert_dicts_close,
    check_two_adamw_steps,
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
RANK, ALPHA = 4, 8.0
DELTANET_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")


@pytest.fixture(scope="module")
def path(tiny_model_dir) -> Path:
    return tiny_model_dir("tiny-qwen3.5")


@pytest.fixture(scope="module")
def backend(path: Path) -> NativeBackend:
    return NativeBackend(path, BackendSettings(max_lora_adapters=3, max_lora_rank=8))


@pytest.fixture(scope="module")
def hf(path: Path) -> torch.nn.Module:
    return load_hf_model(path)


def seqs_of(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def ours(backend: NativeBackend, seqs: list[list[int]], adapters: list[str] | None = None) -> list[torch.Tensor]:
    return backend.token_logprobs([s[:-1] for s in seqs], [s[1:] for s in seqs], adapters)


def random_adapter(backend: NativeBackend, model_id: str, seed: int, rank: int = RANK, alpha: float = ALPHA,
                   **targets) -> dict[str, torch.Tensor]:
    """A LoRA model whose A and B are both random and nonzero; returns its PEFT-named factors."""
    backend.create_model(model_id, lora_rank=rank, alpha=alpha, **targets)
    gen = torch.Generator().manual_seed(seed)
    state = {k: torch.randn(v.shape, generator=gen) * 0.1 for k, v in backend.trainable_state(model_id).items()}
    backend.set_adapter_weights(model_id, state)
    return state


def test_hybrid_layout_and_config(backend: NativeBackend, hf: torch.nn.Module) -> None:
    cfg = backend.decoder_config
    assert cfg.layer_types == ("linear_attention", "full_attention", "linear_attention", "linear_attention")
    assert (cfg.partial_rotary_factor, cfg.linear_num_key_heads, cfg.linear_num_value_heads) == (0.25, 2, 4)
    assert [layer.block_type for layer in hf.model.layers] == list(cfg.layer_types)


# Lengths around the delta rule's 64-token chunk: inside one, exactly one, one past, several and a ragged tail.
@pytest.mark.parametrize("lengths", [[2, 7, 33], [64, 65], [130, 200]])
def test_base_logprobs_match_transformers(backend: NativeBackend, hf: torch.nn.Module, lengths: list[int]) -> None:
    seqs = seqs_of(backend.decoder_config.vocab_size, lengths, seed=len(lengths) + lengths[0])
    for seq, got in zip(seqs, ours(backend, seqs)):
        assert_close(got, hf_token_logprobs(hf, seq), ATOL)


def test_padded_batch_equals_each_sequence_alone(backend: NativeBackend) -> None:
    seqs = seqs_of(backend.decoder_config.vocab_size, [5, 70, 2, 17], seed=1)
    for seq, got in zip(seqs, ours(backend, seqs)):
        assert_close(got, ours(backend, [seq])[0], 1e-6)


def test_adapter_on_every_projection_equals_merged_transformers(backend: NativeBackend, hf: torch.nn.Module) -> None:
    state = random_adapter(backend, "merged", seed=3)
    try:
        deltanet = {k.split(".linear_attn.")[1].split(".lora_")[0] for k in state if ".linear_attn." in k}
        assert deltanet == set(DELTANET_PROJECTIONS)
        assert sum(".linear_attn." in k for k in state) == 3 * len(DELTANET_PROJECTIONS) * 2  # 3 layers, A and B
        assert any(".self_attn.q_proj." in k for k in state) and any(".mlp.down_proj." in k for k in state)
        seqs = seqs_of(backend.decoder_config.vocab_size, [3, 21, 80], seed=2)
        got = ours(backend, seqs, ["merged"] * len(seqs))
        for seq, lp in zip(seqs, got):
            assert_close(lp, hf_token_logprobs(merge_into(copy.deepcopy(hf), state, ALPHA / RANK), seq), ATOL)
        assert (got[-1] - ours(backend, seqs[-1:])[0]).abs().max() > 1e-3, "the adapter changes the output"
    finally:
        backend.remove_model("merged")


def test_mixed_adapter_batch_equals_rows_alone(backend: NativeBackend, hf: torch.nn.Module) -> None:
    states = {"x": random_adapter(backend, "x", seed=10, rank=2, alpha=4.0),
              "y": random_adapter(backend, "y", seed=11, rank=8, alpha=8.0, train_mlp=False, train_unembed=False)}
    scales = {"x": 2.0, "y": 1.0}
    try:
        seqs = seqs_of(backend.decoder_config.vocab_size, [12, 5, 66, 8, 19], seed=5)
        adapters = ["y", "", "x", "y", "x"]
        for seq, adapter, got in zip(seqs, adapters, ours(backend, seqs, adapters)):
            assert_close(got, ours(backend, [seq], [adapter])[0], 1e-6)
            ref = (hf_token_logprobs(merge_into(copy.deepcopy(hf), states[adapter], scales[adapter]), seq)
                   if adapter else hf_token_logprobs(hf, seq))
            assert_close(got, ref, ATOL)
    finally:
        backend.remove_model("x")
        backend.remove_model("y")


def test_lora_gradients_and_adamw_equal_merged_autograd(backend: NativeBackend, path: Path) -> None:
    state = random_adapter(backend, "train", seed=21)
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
        for name in [k for k in grads if ".linear_attn." in k]:
            assert grads[name].abs().max() > 0, f"{name} gets a gradient"
        assert_dicts_close(grads, grads_of(ref.factors), ATOL, "first pass grads")
        backend.remove_model("train")
        state = random_adapter(backend, "train", seed=21)
        ref = MergedLoraModel(load_hf_model(path), state, ALPHA / RANK)
        check_two_adamw_steps(backend, "train", ref, ref.factors, requests[0], requests[1], ATOL)
    finally:
        backend.remove_model("train")


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


def test_vision_language_checkpoint_serves_its_text_model(path: Path, backend: NativeBackend, tmp_path: Path) -> None:
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
