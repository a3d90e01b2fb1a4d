"""DecoderConfig: the decoder hyper-parameters read from a Hugging Face config.json (transformers 4.x and 5.x keys)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from skyrl_tx.errors import InvalidArgumentError, UnimplementedError
from skyrl_tx.models.architectures import BY_ARCHITECTURE, BY_MODEL_TYPE

SUPPORTED_ARCHITECTURES = tuple(BY_ARCHITECTURE)


@dataclass(frozen=True)
class RopeScalingConfig:
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # YaRN (DeepSeek V3)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float = 0.0  # 0: derived from factor and the mscales


@dataclass(frozen=True)
class DecoderConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    qk_norm: bool
    tie_word_embeddings: bool
    attention_bias: bool = False
    mlp_bias: bool = False
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    eos_token_ids: tuple[int, ...] = ()
    # Mixture of experts (0 / defaults for dense models); which layers are MoE follows the registry's layout rule.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    first_k_dense_replace: int = 0
    n_shared_experts: int = 0
    shared_expert_intermediate_size: int = 0  # Qwen3.5 MoE's one sigmoid-gated shared expert
    scoring_func: str = "softmax"  # "sigmoid": DeepSeek V3's router (group-limited, score-correction bias)
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # Multi-head latent attention (DeepSeek V3); head_dim is then qk_rope_head_dim.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    # Qwen3.5: RoPE on a fraction of head_dim; Gated DeltaNet ("linear_attention") layers by layer_types.
    partial_rotary_factor: float = 1.0
    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0


# Vision-language checkpoints whose text model we serve: the class, and what its text_config describes.
TEXT_MODEL_OF = {"Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
                 "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM"}
QWEN3_5_TEXT_MODELS = ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")


def text_model_config(raw: dict[str, Any]) -> dict[str, Any]:
    """A vision-language config.json (Qwen3.5's hub checkpoints) → its text model's config; others unchanged.
    The weights follow with checkpoint.text_model_weight_name."""
    architectures = raw.get("architectures") or []
    if not architectures or architectures[0] not in TEXT_MODEL_OF or "text_config" not in raw:
        return raw
    text = dict(raw["text_config"])
    text["architectures"] = [TEXT_MODEL_OF[architectures[0]]]
    text.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
    if "eos_token_id" not in text and "eos_token_id" in raw:
        text["eos_token_id"] = raw["eos_token_id"]
    return text


def _rope(raw: dict[str, Any]) -> tuple[float, RopeScalingConfig]:
    # transformers 5 nests theta and scaling in rope_parameters; 4.x has rope_theta + rope_scaling.
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or params
    theta = float(raw.get("rope_theta") or params.get("rope_theta") or 10000.0)
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind not in ("default", "llama3", "yarn"):
        raise UnimplementedError(f"config.json: rope scaling type {kind!r} is not supported (supported: llama3, yarn)")
    if kind == "default":
        return theta, RopeScalingConfig()
    if kind == "yarn":
        return theta, RopeScalingConfig(
            type=kind,
            factor=float(scaling["factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
            beta_fast=float(scaling.get("beta_fast") or 32.0),
            beta_slow=float(scaling.get("beta_slow") or 1.0),
            mscale=float(scaling.get("mscale") or 0.0),
            mscale_all_dim=float(scaling.get("mscale_all_dim") or 0.0),
            attention_factor=float(scaling.get("attention_factor") or 0.0),
        )
    return theta, RopeScalingConfig(
        type=kind,
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
    )


def decoder_config_from_dict(raw: dict[str, Any]) -> DecoderConfig:
    raw = text_model_config(raw)
    architectures = raw.get("architectures") or []
    by_type = BY_MODEL_TYPE.get(raw.get("model_type", ""))
    architecture = architectures[0] if architectures else (by_type.architecture if by_type else "")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise UnimplementedError(f"config.json: architecture {architecture!r} is not supported "
                                 f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    if raw.get("use_sliding_window"):
        raise UnimplementedError("config.json: sliding-window attention is not supported")
    try:
        heads = int(raw["num_attention_heads"])
        theta, scaling = _rope(raw)
        eos = raw.get("eos_token_id")
        return DecoderConfig(
            architecture=architecture,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("qk_rope_head_dim") if BY_ARCHITECTURE[architecture].attention == "mla"
                         else raw.get("head_dim") or raw["hidden_size"] // heads),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            rope_theta=theta,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            qk_norm=BY_ARCHITECTURE[architecture].qk_norm,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            rope_scaling=scaling,
            eos_token_ids=tuple(eos if isinstance(eos, list) else ([eos] if eos is not None else [])),
            **_moe_fields(raw, qwen3_5=architecture in QWEN3_5_TEXT_MODELS),
            **_linear_attention_fields(raw, qwen3_5=architecture in QWEN3_5_TEXT_MODELS),
        )
    except KeyError as exc:
        raise InvalidArgumentError(f"config.json: missing required key {exc.args[0]!r}") from exc


def _moe_fields(raw: dict[str, Any], *, qwen3_5: bool) -> dict[str, Any]:
    # Hub configs say num_experts (Qwen3 MoE) or n_routed_experts (DeepSeek); transformers 5 writes num_local_experts.
    experts = raw.get("num_experts") or raw.get("n_routed_experts") or raw.get("num_local_experts") or 0
    return {
        "num_experts": int(experts),
        "num_experts_per_tok": int(raw.get("num_experts_per_tok") or 0),
        "moe_intermediate_size": int(raw.get("moe_intermediate_size") or 0),
        # Qwen3.5 MoE's router always renormalises its top-k (its config has no key for it).
        "norm_topk_prob": bool(raw.get("norm_topk_prob", qwen3_5)),
        "decoder_sparse_step": int(raw.get("decoder_sparse_step") or 1),
        "mlp_only_layers": tuple(int(i) for i in raw.get("mlp_only_layers") or ()),
        "first_k_dense_replace": int(raw.get("first_k_dense_replace") or 0),
        "n_shared_experts": int(raw.get("n_shared_experts") or 0),
        "shared_expert_intermediate_size": int(raw.get("shared_expert_intermediate_size") or 0),
        # DeepSeek V3 configs on the hub say scoring_func "sigmoid"; transformers 5 drops the key (always sigmoid).
        "scoring_func": str(raw.get("scoring_func") or ("sigmoid" if raw.get("model_type") == "deepseek_v3"
                                                        else "softmax")),
        "n_group": int(raw.get("n_group") or 1),
        "topk_group": int(raw.get("topk_group") or 1),
        "routed_scaling_factor": float(raw.get("routed_scaling_factor") or 1.0),
        "q_lora_rank": int(raw.get("q_lora_rank") or 0),
        "kv_lora_rank": int(raw.get("kv_lora_rank") or 0),
        "qk_nope_head_dim": int(raw.get("qk_nope_head_dim") or 0),
        "qk_rope_head_dim": int(raw.get("qk_rope_head_dim") or 0),
        "v_head_dim": int(raw.get("v_head_dim") or 0),
        # transformers' DeepseekV3Config defaults to interleaved RoPE (the hub checkpoints' layout) without the key.
        "rope_interleave": bool(raw.get("rope_interleave", raw.get("model_type") == "deepseek_v3")),
    }


def _linear_attention_fields(raw: dict[str, Any], *, qwen3_5: bool) -> dict[str, Any]:
    # Without the keys, transformers' Qwen3_5TextConfig uses partial_rotary_factor 0.25 and a full-attention
    # layer every full_attention_interval (4) layers; other architectures have neither.
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    layer_types = raw.get("layer_types")
    if layer_types is None and qwen3_5:
        interval = int(raw.get("full_attention_interval") or 4)
        layer_types = ["linear_attention" if (i + 1) % interval else "full_attention"
                       for i in range(int(raw["num_hidden_layers"]))]
    return {
        "partial_rotary_factor": float(raw.get("partial_rotary_factor") or params.get("partial_rotary_factor")
                                       or (0.25 if qwen3_5 else 1.0)),
        "layer_types": tuple(str(t) for t in layer_types or ()),
        "linear_num_key_heads": int(raw.get("linear_num_key_heads") or 0),
        "linear_num_value_heads": int(raw.get("linear_num_value_heads") or 0),
        "linear_key_head_dim": int(raw.get("linear_key_head_dim") or 0),
        "linear_value_head_dim": int(raw.get("linear_value_head_dim") or 0),
        "linear_conv_kernel_dim": int(raw.get("linear_conv_kernel_dim") or 0),
    }


def load_decoder_config(model_dir: Path) -> DecoderConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise InvalidArgumentError(f"base model: {model_dir} has no config.json; pass a Hugging Face model directory")
    return decoder_config_from_dict(json.loads(path.read_text()))
