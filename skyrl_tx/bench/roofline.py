"""MFU and memory-bandwidth roofline arithmetic for the benchmark, and the GPU peak table (by device name)."""

from __future__ import annotations

import dataclasses

from skyrl_tx.models.tiny_presets import TinyPreset

# (name substring, dense bf16 tensor-core FLOP/s, HBM bytes/s), first match wins (PCIe before the SXM default).
GPU_PEAKS: list[tuple[str, float, float]] = [
    ("H200", 989.4e12, 4.8e12),
    ("H100 PCIe", 756.0e12, 2.0e12),
    ("H100", 989.4e12, 3.35e12),  # SXM
    ("A100-SXM4-80GB", 312.0e12, 2.039e12),
    ("A100", 312.0e12, 1.555e12),
]


@dataclasses.dataclass(frozen=True)
class Peaks:
    flops: float | None  # FLOP/s in the benchmark's dtype
    bandwidth: float | None  # bytes/s


def device_peaks(device_name: str, flops_override: float | None = None,
                 bandwidth_override: float | None = None) -> Peaks:
    """Table lookup by name (None when unknown, e.g. a CPU), each overridable from the command line."""
    flops = bandwidth = None
    for needle, table_flops, table_bw in GPU_PEAKS:
        if needle.lower() in device_name.lower():
            flops, bandwidth = table_flops, table_bw
            break
    return Peaks(flops_override or flops, bandwidth_override or bandwidth)


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The matmul shapes of a bench config's model: GQA (gated for Qwen3.5) or Gated DeltaNet mixers, dense or routed
    SwiGLU MLPs. Not modelled: MLA's projections and DeepSeek's shared experts (no bench config uses them)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    # Qwen3.5: how many layers are Gated DeltaNet (the rest softmax attention, whose q_proj also yields the gate),
    # and the DeltaNet's key heads, value heads, key dim, value dim. 0: every layer is plain attention.
    linear_layers: int = 0
    linear_heads: tuple[int, int, int, int] = (0, 0, 0, 0)
    # Mixture of experts: how many layers route, and (experts, top-k, expert width, shared-expert width). A routed
    # layer counts what one token runs: the router, its top-k experts and the shared expert (with its gate).
    moe_layers: int = 0
    experts: tuple[int, int, int, int] = (0, 0, 0, 0)

    @classmethod
    def of(cls, preset: TinyPreset, vocab: int) -> ModelShape:
        from skyrl_tx.models.architectures import BY_ARCHITECTURE, mlp_layout

        extra = preset.extra_config or {}
        linear = sum(t == "linear_attention" for t in extra.get("layer_types", ()))
        heads = tuple(int(extra.get(k, 0)) for k in ("linear_num_key_heads", "linear_num_value_heads",
                                                     "linear_key_head_dim", "linear_value_head_dim"))
        num_experts = int(extra.get("num_experts") or extra.get("n_routed_experts") or 0)
        layout = mlp_layout(BY_ARCHITECTURE[preset.architecture], preset.num_hidden_layers, num_experts=num_experts,
                            decoder_sparse_step=int(extra.get("decoder_sparse_step") or 1),
                            mlp_only_layers=tuple(extra.get("mlp_only_layers") or ()),
                            first_k_dense_replace=int(extra.get("first_k_dense_replace") or 0))
        experts = (num_experts, int(extra.get("num_experts_per_tok") or 0),
                   int(extra.get("moe_intermediate_size") or 0), int(extra.get("shared_expert_intermediate_size") or 0))
        return cls(preset.num_hidden_layers, preset.hidden_size, preset.intermediate_size, preset.num_attention_heads,
                   preset.num_key_value_heads, preset.head_dim, vocab, linear, heads,  # type: ignore[arg-type]
                   layout.count("moe"), experts)

    @property
    def attention_layers(self) -> int:
        return self.layers - self.linear_layers

    def linear_shapes(self) -> list[tuple[int, int]]:
        """(in, out) of every matmul weight one token runs: 4 per attention layer (Qwen3.5: q_proj twice as wide,
        for the gate) or 5 per DeltaNet layer, 3 per dense MLP or the router and top-k experts' 3 each (plus a
        shared expert) per routed MLP, then lm_head (tied or not, it is one matmul)."""
        h, q, kv, m = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        swiglu = lambda width: [(h, width), (h, width), (width, h)]  # noqa: E731
        gated = 2 if self.linear_layers else 1
        attention = [(h, gated * q), (h, kv), (h, kv), (q, h)]
        key_heads, value_heads, key_dim, value_dim = self.linear_heads
        qk, v = key_heads * key_dim, value_heads * value_dim
        deltanet = [(h, 2 * qk + v), (h, v), (h, value_heads), (h, value_heads), (v, h)]
        num_experts, top_k, expert_width, shared_width = self.experts
        routed = [(h, num_experts)] + swiglu(expert_width) * top_k
        if shared_width:
            routed += swiglu(shared_width) + [(h, 1)]
        return (attention * self.attention_layers + deltanet * self.linear_layers
                + swiglu(m) * (self.layers - self.moe_layers) + routed * self.moe_layers + [(h, self.vocab)])

    @property
    def matmul_params(self) -> int:
        """Parameters that take part in matmuls (the input embedding is a lookup, not counted)."""
        return sum(i * o for i, o in self.linear_shapes())

    def lora_params(self, rank: int) -> int:
        return sum(rank * (i + o) for i, o in self.linear_shapes())


def train_flops_per_token(shape: ModelShape, seq_len: int) -> float:
    """6·N (forward 2N + backward 4N, the usual MFU convention) plus causal attention: forward QK^T and AV are
    2·2·H·D per token per key over the average T/2 keys, times 3 for forward + backward (PaLM appendix B,
    halved for the causal mask)."""
    attention = 3 * 2 * 2 * shape.attention_layers * shape.heads * shape.head_dim * (seq_len / 2)
    return 6 * shape.matmul_params + attention


def mfu(shape: ModelShape, seq_len: int, tokens_per_s: float, peak_flops: float) -> float:
    return train_flops_per_token(shape, seq_len) * tokens_per_s / peak_flops


def decode_bytes_per_step(shape: ModelShape, dtype_bytes: int, lora_rank: int, batch: int, prompt_len: int,
                          new_tokens: int) -> float:
    """The least a decode step must read: every matmul weight once, the adapter (float32 factors), each row's
    K and V over its context, averaged over the generation (prompt + new_tokens / 2), and each row's DeltaNet state
    (float32 [value heads, key dim, value dim] per linear layer, read and written)."""
    weights = shape.matmul_params * dtype_bytes + shape.lora_params(lora_rank) * 4
    context = prompt_len + new_tokens / 2
    kv = 2 * shape.attention_layers * shape.kv_heads * shape.head_dim * dtype_bytes * batch * context
    _, value_heads, key_dim, value_dim = shape.linear_heads
    state = 2 * shape.linear_layers * value_heads * key_dim * value_dim * 4 * batch
    return weights + kv + state


def roofline_fraction(bytes_per_step: float, step_seconds: float, peak_bandwidth: float) -> float:
    return bytes_per_step / step_seconds / peak_bandwidth
