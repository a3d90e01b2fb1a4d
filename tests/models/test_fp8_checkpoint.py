"""DeepSeek V3 as published: FP8 (float8_e4m3fn) block-quantised weights with float32 `weight_scale_inv` scales,
sharded with an index, plus the multi-token-prediction layer. A tiny copy of the tiny-deepseek-v3 preset in that
layout loads (dequantised at load) to exactly the weights and logprobs of its bfloat16 twin."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from backend_parity import ours, seqs_of
from safetensors.torch import load_file, save_file

from skyrl_tx.backend.native import NativeBackend
from skyrl_tx.config import BackendSettings
from skyrl_tx.errors import InvalidArgumentError, UnimplementedError
from skyrl_tx.models.checkpoint import load_weights

BLOCK = [16, 24]  # small enough that every projection has several blocks, most with ragged edges (hub: [128, 128])
FP8_MAX = 448.0
QUANT = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": BLOCK}
NUM_LAYERS = 3  # the preset's; the MTP layer is model.layers.3


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's block quantisation: per block scale = amax / 448, fp8 = w / scale; returns (fp8, scale_inv)."""
    rows, cols = w.shape
    nr, nc = -(-rows // BLOCK[0]), -(-cols // BLOCK[1])
    scale = torch.empty(nr, nc)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(nr):
        for j in range(nc):
            blk = w[i * BLOCK[0]:(i + 1) * BLOCK[0], j * BLOCK[1]:(j + 1) * BLOCK[1]]
            scale[i, j] = blk.abs().max().clamp(min=1e-12) / FP8_MAX
            q[i * BLOCK[0]:(i + 1) * BLOCK[0], j * BLOCK[1]:(j + 1) * BLOCK[1]] = \
                (blk / scale[i, j]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_by_blocks(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The reference: each block of the fp8 weight (as float32) times its own scale, edge blocks ragged."""
    out = torch.empty(q.shape)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rs, cs = slice(i * BLOCK[0], (i + 1) * BLOCK[0]), slice(j * BLOCK[1], (j + 1) * BLOCK[1])
            out[rs, cs] = q[rs, cs].float() * scale[i, j]
    return out


def is_quantized(name: str, t: torch.Tensor) -> bool:
    """As on the hub: every linear weight of the decoder layers; not the embedding, lm_head, norms or router."""
    return t.dim() == 2 and ".layers." in name and not name.endswith(("mlp.gate.weight", "norm.weight",
                                                                      "embed_tokens.weight", "head.weight"))


def with_mtp_layer(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The hub's model.layers.{num_hidden_layers}: a decoder layer (here a copy of the last one) plus the MTP
    module's own tensors."""
    mtp = {k.replace(f"layers.{NUM_LAYERS - 1}.", f"layers.{NUM_LAYERS}.", 1): v.clone()
           for k, v in weights.items() if k.startswith(f"model.layers.{NUM_LAYERS - 1}.")}
    hidden = weights["model.embed_tokens.weight"].shape[1]
    prefix = f"model.layers.{NUM_LAYERS}."
    mtp |= {prefix + "embed_tokens.weight": weights["model.embed_tokens.weight"].clone(),
            prefix + "enorm.weight": torch.ones(hidden), prefix + "hnorm.weight": torch.ones(hidden),
            prefix + "eh_proj.weight": torch.randn(hidden, 2 * hidden) * 0.02,
            prefix + "shared_head.norm.weight": torch.ones(hidden),
            prefix + "shared_head.head.weight": weights["lm_head.weight"].clone()}
    return {**weights, **mtp}


def write_sharded(out: Path, tensors: dict[str, torch.Tensor], config: dict, preset: Path, shards: int = 3) -> Path:
    """model-0000i-of-0000n.safetensors + model.safetensors.index.json, as the hub shards; tensors are dealt out in
    name order, so a weight and its scale can land in different shards."""
    out.mkdir()
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[i::shards]}
        save_file(part, str(out / file), metadata={"format": "pt"})
        weight_map |= {n: file for n in part}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (out / name).write_bytes((preset / name).read_bytes())
    return out


@pytest.fixture(scope="module")
def checkpoints(tiny_model_dir, tmp_path_factory) -> tuple[Path, Path, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """(the FP8 directory, its bf16 twin, {name: (fp8, scale_inv)})."""
    preset = tiny_model_dir("tiny-deepseek-v3")
    base = with_mtp_layer(load_file(str(preset / "model.safetensors")))
    config = json.loads((preset / "config.json").read_text())
    assert config["num_hidden_layers"] == NUM_LAYERS and config["num_nextn_predict_layers"] == 1
    fp8, twin, quantized = {}, {}, {}
    for name, w in base.items():
        keep = torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16  # as the hub keeps it
        if is_quantized(name, w):
            q, scale = quantize(w)
            quantized[name] = (q, scale)
            fp8[name], fp8[name + "_scale_inv"] = q, scale
            twin[name] = dequantize_by_blocks(q, scale).to(torch.bfloat16)
        else:
            fp8[name] = twin[name] = w.to(keep)
    root = tmp_path_factory.mktemp("fp8")
    fp8_dir = write_sharded(root / "fp8", fp8, {**config, "quantization_config": QUANT}, preset)
    twin_dir = write_sharded(root / "bf16", twin, config, preset)
    return fp8_dir, twin_dir, quantized


def test_fp8_weights_dequantise_to_the_bf16_twin(checkpoints, caplog) -> None:
    fp8_dir, twin_dir, quantized = checkpoints
    assert len(quantized) > 20 and any(q.shape[0] % BLOCK[0] and q.shape[1] % BLOCK[1] for q, _ in quantized.values())
    with caplog.at_level(logging.INFO, logger="skyrl_tx.models"):
        got = load_weights(fp8_dir, dtype=torch.bfloat16)
    mtp_lines = [r.getMessage() for r in caplog.records if "leaving out" in r.getMessage()]
    assert len(mtp_lines) == 1 and "[3]" in mtp_lines[0], mtp_lines
    twin = load_weights(twin_dir)
    assert sorted(got) == sorted(twin)
    assert not [k for k in got if "scale_inv" in k or k.startswith(f"model.layers.{NUM_LAYERS}.")]
    for name, tensor in twin.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    # At float32: exactly transformers' own FP8 dequantisation (its FP8 linear's backward) and the block reference.
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    as_f32 = load_weights(fp8_dir, dtype=torch.float32)
    for name, (q, scale) in quantized.items():
        if name.startswith(f"model.layers.{NUM_LAYERS}."):
            continue
        assert as_f32[name].dtype == torch.float32
        assert torch.equal(as_f32[name], _dequantize_fp8_weight(q, scale, BLOCK, torch.float32)), name
        assert torch.equal(as_f32[name], dequantize_by_blocks(q, scale)), name


def test_fp8_checkpoint_gives_the_twins_logprobs(checkpoints, tiny_model_dir) -> None:
    fp8_dir, twin_dir, _ = checkpoints
    settings = BackendSettings(dtype="bfloat16", max_lora_adapters=1, max_lora_rank=4)
    fp8, twin = NativeBackend(fp8_dir, settings), NativeBackend(twin_dir, settings)
    seqs = seqs_of(twin.decoder_config.vocab_size, [17, 40], seed=5)
    for got, expected in zip(ours(fp8, seqs), ours(twin, seqs)):
        assert torch.equal(got, expected)
    # ...and they are the preset's model, up to FP8's rounding (the dequantised weights are not noise).
    ref = ours(NativeBackend(tiny_model_dir("tiny-deepseek-v3"), settings), seqs)
    assert max((a - b).abs().max().item() for a, b in zip(ours(fp8, seqs), ref)) < 0.05


def rewrite(src: Path, dst: Path, *, drop: str | None = None, quant: dict | None = None) -> Path:
    """A copy of the FP8 directory without tensor `drop` or with another quantization_config."""
    dst.mkdir()
    index = json.loads((src / "model.safetensors.index.json").read_text())
    for file in set(index["weight_map"].values()):
        tensors = load_file(str(src / file))
        tensors.pop(drop, None)
        save_file(tensors, str(dst / file))
    index["weight_map"].pop(drop, None)
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((src / "config.json").read_text())
    if quant is not None:
        config["quantization_config"] = quant
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_missing_scale_is_refused_by_name(checkpoints, tmp_path: Path) -> None:
    fp8_dir, _, _ = checkpoints
    key = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"
    broken = rewrite(fp8_dir, tmp_path / "broken", drop=key + "_scale_inv")
    with pytest.raises(InvalidArgumentError, match=rf"{key}.*{key}_scale_inv.*incomplete"):
        load_weights(broken)


@pytest.mark.parametrize("quant,match", [
    ({**QUANT, "fmt": "e5m2"}, r"quantization_config\.fmt = 'e5m2' is not supported"),
    ({**QUANT, "scale_fmt": "ue8m0"}, r"quantization_config\.scale_fmt = 'ue8m0' is not supported"),
    ({**QUANT, "weight_block_size": None}, r"quantization_config\.weight_block_size = None"),
    ({**QUANT, "activation_scheme": "static"}, r"quantization_config\.activation_scheme = 'static'"),
    ({"quant_method": "awq", "bits": 4}, r"quantization_config\.quant_method = 'awq' is not supported"),
])
def test_unknown_quantization_config_is_refused(checkpoints, tmp_path: Path, quant: dict, match: str) -> None:
    fp8_dir, _, _ = checkpoints
    with pytest.raises(UnimplementedError, match=match + r".*bfloat16 or float32 copy"):
        load_weights(rewrite(fp8_dir, tmp_path / "other", quant=quant))


def test_exports_of_an_fp8_base_are_not_declared_quantized(checkpoints, tmp_path: Path) -> None:
    """A full fine-tune's Hugging Face export copies the base's config.json; its weights were dequantised at load, so
    the copy drops quantization_config (transformers would read the bf16 tensors as FP8 otherwise)."""
    from skyrl_tx.checkpoints.formats import hf_model_files

    fp8_dir, _, _ = checkpoints
    config = json.loads(hf_model_files(fp8_dir, {})["config.json"])
    assert "quantization_config" not in config and config["model_type"] == "deepseek_v3"
