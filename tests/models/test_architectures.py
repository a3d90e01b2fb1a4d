"""The Python architecture table agrees with the C++ registry, and config.json layouts agree with the C++ layout."""

from __future__ import annotations

import dataclasses

import pytest

from skyrl_tx._ext import load_extension
from skyrl_tx.errors import UnimplementedError
from skyrl_tx.models.architectures import ARCHITECTURES, BY_ARCHITECTURE, mlp_layout
from skyrl_tx.models.hf_config import decoder_config_from_dict


def test_python_table_equals_cpp_registry() -> None:
    assert [dataclasses.asdict(spec) for spec in ARCHITECTURES] == load_extension().supported_architectures()


def _native_layout(architecture: str, layers: int, **moe) -> list[str]:
    c = load_extension().ModelConfig()
    c.architecture = architecture
    c.num_hidden_layers = layers
    for key, value in moe.items():
        setattr(c, key, value)
    return c.mlp_layout()


@pytest.mark.parametrize("architecture,layers,moe,expected", [
    ("Qwen3ForCausalLM", 3, {}, ["dense"] * 3),
    ("Qwen3MoeForCausalLM", 4, {"num_experts": 8}, ["moe"] * 4),
    ("Qwen3MoeForCausalLM", 4, {"num_experts": 8, "mlp_only_layers": (0, 3)}, ["dense", "moe", "moe", "dense"]),
    ("Qwen3MoeForCausalLM", 4, {"num_experts": 8, "decoder_sparse_step": 2}, ["dense", "moe", "dense", "moe"]),
    ("Qwen3MoeForCausalLM", 2, {"num_experts": 0}, ["dense", "dense"]),
])
def test_layouts_agree(architecture: str, layers: int, moe: dict, expected: list[str]) -> None:
    assert mlp_layout(BY_ARCHITECTURE[architecture], layers, **moe) == expected
    assert _native_layout(architecture, layers, **moe) == expected


def test_qwen3_moe_config_keys_from_hub_and_transformers5() -> None:
    raw = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 8,
           "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
           "head_dim": 4, "moe_intermediate_size": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
           "decoder_sparse_step": 1, "mlp_only_layers": [1]}
    hub = decoder_config_from_dict({**raw, "num_experts": 6})
    tf5 = decoder_config_from_dict({**raw, "num_local_experts": 6})  # what transformers 5 writes
    assert hub == tf5
    assert (hub.num_experts, hub.num_experts_per_tok, hub.mlp_only_layers, hub.qk_norm) == (6, 2, (1,), True)
    # No "architectures": the model_type names the class.
    assert decoder_config_from_dict({k: v for k, v in raw.items() if k != "architectures"}).architecture == \
        "Qwen3MoeForCausalLM"


def test_unknown_architecture_names_the_supported_ones() -> None:
    with pytest.raises(UnimplementedError, match="Qwen3MoeForCausalLM"):
        decoder_config_from_dict({"architectures": ["MixtralForCausalLM"]})


# The MoE/MLA keys of deepseek-ai/DeepSeek-V3's config.json (shapes shrunk), as hub checkpoints spell them.
DEEPSEEK_HUB = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 64,
                "hidden_size": 16, "intermediate_size": 32, "moe_intermediate_size": 8, "num_hidden_layers": 3,
                "num_attention_heads": 2, "num_key_value_heads": 2, "n_routed_experts": 8, "n_shared_experts": 1,
                "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
                "scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True,
                "first_k_dense_replace": 1, "q_lora_rank": 8, "kv_lora_rank": 4, "qk_nope_head_dim": 4,
                "qk_rope_head_dim": 2, "v_head_dim": 4, "num_nextn_predict_layers": 1, "rope_theta": 10000,
                "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                                 "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}}


def test_deepseek_v3_hub_config() -> None:
    cfg = decoder_config_from_dict(DEEPSEEK_HUB)
    assert (cfg.num_experts, cfg.n_shared_experts, cfg.scoring_func, cfg.n_group, cfg.topk_group) == \
        (8, 1, "sigmoid", 4, 2)
    assert (cfg.head_dim, cfg.kv_lora_rank, cfg.rope_interleave, cfg.qk_norm) == (2, 4, True, False)
    assert (cfg.rope_scaling.type, cfg.rope_scaling.factor, cfg.rope_scaling.mscale_all_dim) == ("yarn", 40.0, 1.0)
    assert mlp_layout(BY_ARCHITECTURE[cfg.architecture], 3, first_k_dense_replace=1) == ["dense", "moe", "moe"]
    from skyrl_tx.backend.native import _native_model_config

    native = _native_model_config(cfg)
    native.validate()
    assert native.mlp_layout() == ["dense", "moe", "moe"]


def test_multi_token_prediction_layers_are_left_out_and_unknown_quantization_refused(tmp_path) -> None:
    """(FP8 checkpoints that load: tests/models/test_fp8_checkpoint.py.)"""
    import json

    import torch
    from safetensors.torch import save_file

    from skyrl_tx.models.checkpoint import load_weights

    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_HUB))
    save_file({"model.layers.2.x": torch.zeros(1), "model.layers.3.x": torch.zeros(1), "lm_head.weight": torch.zeros(1)},
              str(tmp_path / "model.safetensors"))
    assert sorted(load_weights(tmp_path)) == ["lm_head.weight", "model.layers.2.x"]
    (tmp_path / "config.json").write_text(json.dumps({**DEEPSEEK_HUB, "quantization_config": {"quant_method": "gptq"}}))
    with pytest.raises(UnimplementedError, match="quant_method = 'gptq' is not supported"):
        load_weights(tmp_path)
