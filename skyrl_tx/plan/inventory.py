"""The tensors a decoder holds, by hub name and shape, and how each one is laid out over tensor/expert-parallel ranks.

Torch-free (the memory plan runs before anything loads): computed from DecoderConfig the way the C++ core builds its
modules (csrc/models/*.cpp: every linear is a LoraLinear; the split of each follows make_parallel_linear's caller).
tests/plan/test_inventory.py checks the totals against transformers' own models built on the meta device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from skyrl_tx.models.architectures import BY_ARCHITECTURE, mlp_layout
from skyrl_tx.models.hf_config import DecoderConfig

# How a tensor is laid out over the T ranks of a tensor-parallel group (and E expert-parallel ranks).
COLUMN, ROW, REPLICATED, VOCAB, EXPERT = "column", "row", "replicated", "vocab", "expert"


@dataclass(frozen=True)
class Param:
    name: str  # the hub checkpoint's tensor name
    shape: tuple[int, ...]  # whole (unsharded); a linear's is [out, in]
    split: str  # COLUMN (dim 0 / T), ROW (dim 1 / T), REPLICATED, VOCAB (dim 0 / T), EXPERT (whole, 1/E of them)
    lora: bool = False  # a linear with LoRA factors (every linear of the core is a LoraLinear)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def numel_per_rank(self, tp: int) -> int:
        return self.numel // tp if self.split in (COLUMN, ROW, VOCAB) else self.numel

    def lora_width_per_rank(self, tp: int) -> int:
        """in + out of this linear on one rank: the columns of its A [R, in] plus the rows of its B [out, R]."""
        out, inp = self.shape
        if self.split in (COLUMN, VOCAB):
            return out // tp + inp
        if self.split == ROW:
            return out + inp // tp
        return out + inp


def _linear(name: str, out: int, inp: int, split: str, bias: bool = False) -> list[Param]:
    params = [Param(f"{name}.weight", (out, inp), split, lora=True)]
    if bias:
        params.append(Param(f"{name}.bias", (out,), COLUMN if split == COLUMN else REPLICATED))
    return params


def _gqa(c: DecoderConfig, p: str, gated: bool) -> list[Param]:
    q_out = c.num_attention_heads * c.head_dim * (2 if gated else 1)  # Qwen3.5: the output gate rides on q_proj
    kv_out = c.num_key_value_heads * c.head_dim
    out = (_linear(f"{p}.q_proj", q_out, c.hidden_size, COLUMN, c.attention_bias)
           + _linear(f"{p}.k_proj", kv_out, c.hidden_size, COLUMN, c.attention_bias)
           + _linear(f"{p}.v_proj", kv_out, c.hidden_size, COLUMN, c.attention_bias)
           + _linear(f"{p}.o_proj", c.hidden_size, c.num_attention_heads * c.head_dim, ROW, c.attention_bias))
    if c.qk_norm:
        out += [Param(f"{p}.q_norm.weight", (c.head_dim,), REPLICATED),
                Param(f"{p}.k_norm.weight", (c.head_dim,), REPLICATED)]
    return out


def _mla(c: DecoderConfig, p: str) -> list[Param]:
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    heads = c.num_attention_heads
    if c.q_lora_rank:
        out = (_linear(f"{p}.q_a_proj", c.q_lora_rank, c.hidden_size, REPLICATED, c.attention_bias)
               + [Param(f"{p}.q_a_layernorm.weight", (c.q_lora_rank,), REPLICATED)]
               + _linear(f"{p}.q_b_proj", heads * qk, c.q_lora_rank, COLUMN))
    else:
        out = _linear(f"{p}.q_proj", heads * qk, c.hidden_size, COLUMN)
    return out + (
        _linear(f"{p}.kv_a_proj_with_mqa", c.kv_lora_rank + c.qk_rope_head_dim, c.hidden_size, REPLICATED,
                c.attention_bias)
        + [Param(f"{p}.kv_a_layernorm.weight", (c.kv_lora_rank,), REPLICATED)]
        + _linear(f"{p}.kv_b_proj", heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank, COLUMN)
        + _linear(f"{p}.o_proj", c.hidden_size, heads * c.v_head_dim, ROW, c.attention_bias))


def _gated_deltanet(c: DecoderConfig, p: str) -> list[Param]:
    key_dim = c.linear_num_key_heads * c.linear_key_head_dim
    value_dim = c.linear_num_value_heads * c.linear_value_head_dim
    conv_dim = 2 * key_dim + value_dim
    vh = c.linear_num_value_heads
    return (_linear(f"{p}.in_proj_qkv", conv_dim, c.hidden_size, COLUMN)
            + _linear(f"{p}.in_proj_z", value_dim, c.hidden_size, COLUMN)
            + _linear(f"{p}.in_proj_b", vh, c.hidden_size, COLUMN)
            + _linear(f"{p}.in_proj_a", vh, c.hidden_size, COLUMN)
            + _linear(f"{p}.out_proj", c.hidden_size, value_dim, ROW)
            + [Param(f"{p}.conv1d.weight", (conv_dim, 1, c.linear_conv_kernel_dim), COLUMN),
               Param(f"{p}.A_log", (vh,), COLUMN), Param(f"{p}.dt_bias", (vh,), COLUMN),
               Param(f"{p}.norm.weight", (c.linear_value_head_dim,), REPLICATED)])


def _swiglu(c: DecoderConfig, p: str, width: int, split_in: str = COLUMN, split_out: str = ROW) -> list[Param]:
    return (_linear(f"{p}.gate_proj", width, c.hidden_size, split_in, c.mlp_bias)
            + _linear(f"{p}.up_proj", width, c.hidden_size, split_in, c.mlp_bias)
            + _linear(f"{p}.down_proj", c.hidden_size, width, split_out, c.mlp_bias))


def _moe(c: DecoderConfig, p: str) -> list[Param]:
    out = [Param(f"{p}.gate.weight", (c.num_experts, c.hidden_size), REPLICATED)]
    if c.scoring_func == "sigmoid":
        out.append(Param(f"{p}.gate.e_score_correction_bias", (c.num_experts,), REPLICATED))
    for j in range(c.num_experts):
        out += _swiglu(c, f"{p}.experts.{j}", c.moe_intermediate_size, EXPERT, EXPERT)
    # Shared experts run whole on every tensor-parallel rank, as the router does (csrc/models/causal_lm.cpp).
    if c.n_shared_experts:  # DeepSeek V3: n shared experts as one MLP of n times the width
        out += _swiglu(c, f"{p}.shared_experts", c.moe_intermediate_size * c.n_shared_experts, REPLICATED, REPLICATED)
    if c.shared_expert_intermediate_size:  # Qwen3.5 MoE: one sigmoid-gated shared expert
        out += _swiglu(c, f"{p}.shared_expert", c.shared_expert_intermediate_size, REPLICATED, REPLICATED)
        out.append(Param(f"{p}.shared_expert_gate.weight", (1, c.hidden_size), REPLICATED))
    return out


def mlp_kinds(c: DecoderConfig) -> list[str]:
    """"dense" or "moe" per layer, by the architecture's layout rule (models/architectures.py)."""
    return mlp_layout(BY_ARCHITECTURE[c.architecture], c.num_hidden_layers, num_experts=c.num_experts,
                      decoder_sparse_step=c.decoder_sparse_step, mlp_only_layers=c.mlp_only_layers,
                      first_k_dense_replace=c.first_k_dense_replace)


def layer_params(c: DecoderConfig, index: int, mlp_kind: str) -> list[Param]:
    spec = BY_ARCHITECTURE[c.architecture]
    p = f"model.layers.{index}"
    kinds = c.layer_types or ()
    if kinds and kinds[index] == "linear_attention":
        mixer = _gated_deltanet(c, f"{p}.linear_attn")
    elif spec.attention == "mla":
        mixer = _mla(c, f"{p}.self_attn")
    else:
        mixer = _gqa(c, f"{p}.self_attn", gated=spec.attention == "gated_gqa")
    mlp = _moe(c, f"{p}.mlp") if mlp_kind == "moe" else _swiglu(c, f"{p}.mlp", c.intermediate_size)
    norms = [Param(f"{p}.input_layernorm.weight", (c.hidden_size,), REPLICATED),
             Param(f"{p}.post_attention_layernorm.weight", (c.hidden_size,), REPLICATED)]
    return mixer + mlp + norms


def model_params(c: DecoderConfig) -> list[Param]:
    """Every tensor of the model (tied embeddings once), in hub names."""
    out = [Param("model.embed_tokens.weight", (c.vocab_size, c.hidden_size), VOCAB)]
    for i, kind in enumerate(mlp_kinds(c)):
        out += layer_params(c, i, kind)
    out.append(Param("model.norm.weight", (c.hidden_size,), REPLICATED))
    if not c.tie_word_embeddings:
        out.append(Param("lm_head.weight", (c.vocab_size, c.hidden_size), VOCAB, lora=True))
    return out


def lora_linears(c: DecoderConfig) -> list[Param]:
    """The linears that carry LoRA factors: every linear, and the LM head (the tied embedding's, when tied)."""
    linears = [p for p in model_params(c) if p.lora]
    if c.tie_word_embeddings:
        linears.append(Param("lm_head.weight", (c.vocab_size, c.hidden_size), VOCAB, lora=True))
    return linears
