"""Published models' config.json as the hub has them, and their depth-cut twins (every width kept) for tests and plans.

Written down here because the hub is not reachable from CI: each entry is the model card's config.json, trimmed to
the keys a loader reads. Qwen3.5's is transformers' Qwen3_5TextConfig default, which its docstring documents as the
Qwen3.5-9B configuration, wrapped the way the hub's Qwen3_5ForConditionalGeneration checkpoints nest it.
"""

from __future__ import annotations

import copy
from typing import Any

_QWEN3_COMMON = {"attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128,
                 "hidden_act": "silu", "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_scaling": None,
                 "rope_theta": 1000000.0, "torch_dtype": "bfloat16", "use_sliding_window": False,
                 "vocab_size": 151936}

PUBLISHED: dict[str, dict[str, Any]] = {
    "Qwen/Qwen3-0.6B": {**_QWEN3_COMMON, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                        "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                        "num_attention_heads": 16, "num_key_value_heads": 8, "tie_word_embeddings": True},
    "Qwen/Qwen3-8B": {**_QWEN3_COMMON, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                      "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                      "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": False},
    "meta-llama/Llama-3.1-8B": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "mlp_bias": False,
        "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
        "intermediate_size": 14336, "max_position_embeddings": 131072, "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256},
    "Qwen/Qwen3-30B-A3B": {**_QWEN3_COMMON, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                           "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
                           "num_attention_heads": 32, "num_key_value_heads": 4, "tie_word_embeddings": False,
                           "decoder_sparse_step": 1, "mlp_only_layers": [], "moe_intermediate_size": 768,
                           "norm_topk_prob": True, "num_experts": 128, "num_experts_per_tok": 8},
    "deepseek-ai/DeepSeek-V3": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "bos_token_id": 0,
        "eos_token_id": 1, "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
        "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
        "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
        "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
        "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
        "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
        "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "v_head_dim": 128,
        "vocab_size": 129280,
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "weight_block_size": [128, 128]}},
    "Qwen/Qwen3.5-9B": {
        "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "tie_word_embeddings": False,
        "text_config": {
            "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288,
            "num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256,
            "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-06, "eos_token_id": 248044,
            "rope_parameters": {"rope_theta": 10000.0, "partial_rotary_factor": 0.25, "rope_type": "default"},
            "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 8}},
}


def reduced(name: str, num_layers: int = 2, *, num_experts: int | None = None) -> dict[str, Any]:
    """`name`'s config.json with `num_hidden_layers` cut to `num_layers` (every width kept). The layer pattern keeps
    one layer of each kind where the model has two (DeepSeek V3: a dense then an MoE layer; Qwen3.5: a Gated
    DeltaNet then a gated-attention layer); `num_experts` cuts the routed expert count (DeepSeek V3's 256 experts of
    width 2048 are 22 GB a layer in bf16), keeping top-k and the group count valid."""
    config = copy.deepcopy(PUBLISHED[name])
    text = config.get("text_config", config)
    text["num_hidden_layers"] = num_layers
    if "layer_types" in text:
        text["layer_types"] = (["linear_attention"] * (num_layers - 1) + ["full_attention"])[:num_layers]
    if "first_k_dense_replace" in text:
        text["first_k_dense_replace"] = min(text["first_k_dense_replace"], num_layers - 1)
    if num_experts is not None:
        key = "n_routed_experts" if "n_routed_experts" in text else "num_experts"
        text[key] = num_experts
        text["num_experts_per_tok"] = min(text["num_experts_per_tok"], num_experts)
        if "n_group" in text:  # groups must divide the experts, and at least top-k experts must stay selectable
            text["n_group"] = min(text["n_group"], num_experts)
            while num_experts % text["n_group"]:
                text["n_group"] -= 1
            text["topk_group"] = min(text["topk_group"], text["n_group"])
    return config
