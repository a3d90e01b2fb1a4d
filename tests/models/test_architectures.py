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
