"""The benchmark's matmul-parameter count (MFU's 6N, the decode roofline's weight bytes) equals the nn.Linear
weights of the transformers model, for a plain and a hybrid (Qwen3.5) preset."""

from __future__ import annotations

import json

import pytest
import torch
from hf_reference import load_hf_model

from skyrl_tx.bench.roofline import ModelShape
from skyrl_tx.models.tiny_presets import PRESETS


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen3.5"])
def test_matmul_params_equal_the_linear_weights(tiny_model_dir, name: str) -> None:
    path = tiny_model_dir(name)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    shape = ModelShape.of(PRESETS[name], vocab)
    hf = load_hf_model(path)
    linear = sum(m.weight.numel() for m in hf.modules() if isinstance(m, torch.nn.Linear))
    assert shape.matmul_params == linear
    assert shape.attention_layers == (1 if name == "tiny-qwen3.5" else 2)
