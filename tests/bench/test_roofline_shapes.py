"""The benchmark's matmul-parameter count (MFU's 6N, the decode roofline's weight bytes) equals what one token runs
through the transformers model: its nn.Linear weights, and for a routed MLP the router and top-k of E experts."""

from __future__ import annotations

import json

import pytest
import torch
from hf_reference import load_hf_model

from skyrl_tx.bench.roofline import ModelShape
from skyrl_tx.models.tiny_presets import PRESETS


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen3.5", "tiny-qwen3-moe", "tiny-qwen3.5-moe"])
def test_matmul_params_equal_what_a_token_runs(tiny_model_dir, name: str) -> None:
    path = tiny_model_dir(name)
    raw = json.loads((path / "config.json").read_text())
    shape = ModelShape.of(PRESETS[name], raw["vocab_size"])
    hf = load_hf_model(path)
    expected = sum(m.weight.numel() for m in hf.modules() if isinstance(m, torch.nn.Linear))
    for layer in hf.model.layers:  # transformers 5: router and experts are plain parameters, experts fused 3-D
        if hasattr(layer.mlp, "experts"):
            fused = layer.mlp.experts.gate_up_proj.numel() + layer.mlp.experts.down_proj.numel()
            expected += layer.mlp.gate.weight.numel() + fused * raw["num_experts_per_tok"] // raw["num_experts"]
    assert shape.matmul_params == expected
    assert shape.attention_layers == (1 if name.startswith("tiny-qwen3.5") else shape.layers)
    assert shape.moe_layers == {"tiny-qwen3-moe": 2, "tiny-qwen3.5-moe": 4}.get(name, 0)


def test_8b_config_has_qwen3_8b_shape() -> None:
    # Qwen3-8B's model card: 6.95B non-embedding parameters (the decoder layers; the norms add only ~0.3M).
    from skyrl_tx.bench.configs import CONFIGS

    cfg = CONFIGS["qwen3-8b"]
    shape = ModelShape.of(cfg.preset, cfg.vocab_size)
    lm_head = cfg.vocab_size * cfg.preset.hidden_size
    assert shape.layers == 36 and shape.attention_layers == 36
    assert shape.matmul_params - lm_head == pytest.approx(6.95e9, rel=0.005)
