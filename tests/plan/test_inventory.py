"""The memory plan's tensor inventory (skyrl_tx/plan/inventory.py) against transformers' own models of the published
configs, built on the meta device (no memory): every parameter counted, per layer and in total."""

from __future__ import annotations

import pytest

from skyrl_tx.models.hf_config import decoder_config_from_dict, text_model_config
from skyrl_tx.plan.inventory import model_params
from skyrl_tx.plan.published import PUBLISHED, reduced


def _hf_parameter_count(config_dict: dict) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = dict(text_model_config(config_dict))
    raw.pop("quantization_config", None)  # builds the bf16 model; FP8 loading is the loader's business
    model_type = raw.pop("model_type")
    config = AutoConfig.for_model(model_type, **raw)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    # DeepSeek V3's router bias is a buffer in transformers (a checkpoint tensor all the same)
    buffers = sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    return sum(p.numel() for p in model.parameters()) + buffers


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_inventory_counts_every_parameter_of_the_published_widths(name: str) -> None:
    config = reduced(name, 2, num_experts=16 if name.startswith("deepseek") else None)
    ours = sum(p.numel for p in model_params(decoder_config_from_dict(config)))
    assert ours == _hf_parameter_count(config)


@pytest.mark.parametrize("name, billions", [("Qwen/Qwen3-0.6B", 0.60), ("Qwen/Qwen3-8B", 8.19),
                                            ("meta-llama/Llama-3.1-8B", 8.03), ("Qwen/Qwen3-30B-A3B", 30.53),
                                            ("deepseek-ai/DeepSeek-V3", 671.0)])
def test_full_depth_totals_match_the_model_cards(name: str, billions: float) -> None:
    """At full depth the inventory adds up to the parameter count each model card publishes (DeepSeek V3: 671B
    without its multi-token-prediction layer, which serving skips)."""
    total = sum(p.numel for p in model_params(decoder_config_from_dict(PUBLISHED[name])))
    assert total / 1e9 == pytest.approx(billions, rel=0.01)
