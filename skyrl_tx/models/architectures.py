"""The Python half of the architecture registry: HF model_type ↔ class, attention kind, MLP layout rule, norms.

The C++ core has its own table (csrc/models/architectures.cpp, `_C.supported_architectures()`); the API process
reads this one without loading torch. tests/models/test_architectures.py checks that the two agree.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ArchitectureSpec:
    model_type: str  # config.json "model_type"
    architecture: str  # config.json "architectures"[0]
    attention: str  # "gqa" | "mla" (multi-head latent attention) | "gated_gqa" (Qwen3.5: sigmoid output gate)
    layout: str  # "all_dense" | "sparse_step" (qwen3_moe) | "first_k_dense" (deepseek_v3)
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE
    zero_centered_norm: bool = False  # every RMSNorm scales by (1 + weight) (Qwen3.5)


ARCHITECTURES: tuple[ArchitectureSpec, ...] = (
    ArchitectureSpec("qwen3", "Qwen3ForCausalLM", "gqa", "all_dense", True),
    ArchitectureSpec("llama", "LlamaForCausalLM", "gqa", "all_dense", False),
    ArchitectureSpec("qwen3_moe", "Qwen3MoeForCausalLM", "gqa", "sparse_step", True),
    ArchitectureSpec("deepseek_v3", "DeepseekV3ForCausalLM", "mla", "first_k_dense", False),
    # Qwen3.5's text model: Gated DeltaNet ("linear_attention") and gated-attention layers per config layer_types.
    ArchitectureSpec("qwen3_5_text", "Qwen3_5ForCausalLM", "gated_gqa", "all_dense", True, True),
    # ... and its MoE text model (every layer routed experts and a sigmoid-gated shared expert).
    ArchitectureSpec("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", "gated_gqa", "sparse_step", True, True),
)

BY_ARCHITECTURE = {spec.architecture: spec for spec in ARCHITECTURES}
BY_MODEL_TYPE = {spec.model_type: spec for spec in ARCHITECTURES}


def mlp_layout(spec: ArchitectureSpec, num_layers: int, *, num_experts: int = 0, decoder_sparse_step: int = 1,
               mlp_only_layers: tuple[int, ...] = (), first_k_dense_replace: int = 0) -> list[str]:
    """One of "dense" / "moe" per layer (the C++ ModelConfig.mlp_layout() must return the same)."""
    if spec.layout == "all_dense":
        return ["dense"] * num_layers
    if spec.layout == "sparse_step":  # transformers' Qwen3MoeDecoderLayer
        return ["moe" if i not in mlp_only_layers and num_experts > 0 and (i + 1) % decoder_sparse_step == 0
                else "dense" for i in range(num_layers)]
    if spec.layout == "first_k_dense":
        return ["moe" if i >= first_k_dense_replace else "dense" for i in range(num_layers)]
    raise AssertionError(f"unknown layout rule {spec.layout!r}")
