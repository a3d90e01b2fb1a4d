// GatedDeltaNet: Qwen3.5's linear-attention token mixer (causal conv1d, gated delta rule, gated RMSNorm) and its
// chunked (prefill, training) and recurrent (decode) forms.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <utility>
#include <vector>

#include "models/layers.h"

namespace skyrl_tx::models {

/// The gated delta rule over a whole sequence in chunks of `chunk_size` (transformers'
/// torch_chunk_gated_delta_rule with use_qk_l2norm_in_kernel), differentiable: ops::chunk_gated_delta_rule_cpu on
/// float32 CPU tensors with the fused CPU ops on, else chunk_gated_delta_rule_formula.
/// q, k: [B, T, Hk, Dk]; v: [B, T, Hv, Dv]; g (log decay, <= 0), beta: [B, T, Hv]; initial_state: undefined or
/// [B, Hv, Dk, Dv]. Returns (out [B, T, Hv, Dv] in q's dtype, final state [B, Hv, Dk, Dv] float32).
std::pair<at::Tensor, at::Tensor> chunk_gated_delta_rule(const at::Tensor& q, const at::Tensor& k,
                                                         const at::Tensor& v, const at::Tensor& g,
                                                         const at::Tensor& beta, int64_t chunk_size,
                                                         const at::Tensor& initial_state);
/// The same rule as transformers' formula, op for op, through ATen autograd: chunk_gated_delta_rule's twin and oracle,
/// and what it runs where ops::chunk_gated_delta_rule_cpu does not apply (other dtypes, other devices).
std::pair<at::Tensor, at::Tensor> chunk_gated_delta_rule_formula(const at::Tensor& q, const at::Tensor& k,
                                                                 const at::Tensor& v, const at::Tensor& g,
                                                                 const at::Tensor& beta, int64_t chunk_size,
                                                                 const at::Tensor& initial_state);
/// One token of the same rule (transformers' torch_recurrent_gated_delta_rule, T = 1): q, k: [B, 1, Hk, Dk];
/// v: [B, 1, Hv, Dv]; g, beta: [B, 1, Hv]; state: [B, Hv, Dk, Dv] float32, updated in place. Returns out like above.
at::Tensor recurrent_gated_delta_step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& g, const at::Tensor& beta, at::Tensor& state);

/// The depthwise causal conv1d (kernel - 1 zeros before each sequence) and its SiLU over a whole sequence: x [B, T, C],
/// weight [C, kernel] → [B, T, C] (at::conv1d on x transposed to [B, C, T], then back).
at::Tensor causal_conv_silu(const at::Tensor& x, const at::Tensor& weight);

/// One token of the depthwise causal conv1d (the decode step's twin of at::conv1d with kernel - 1 left padding):
/// x [B, C, 1], state [B, C, kernel - 1] (the last inputs, oldest first; shifted in place to end with x), weight
/// [C, kernel]. Returns [B, C, 1] in the state's dtype, before the activation.
at::Tensor causal_conv_step(const at::Tensor& x, at::Tensor& state, const at::Tensor& weight);

/// RMSNorm over each value head, then times silu(gate) (Qwen3_5RMSNormGated: plain weight, not zero-centred).
class GatedRmsNorm {
 public:
  GatedRmsNorm(at::Tensor weight, double eps) : weight_(std::move(weight)), eps_(eps) {}
  /// x, gate: [N, dim] → [N, dim] in x's dtype.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& gate) const;
  const at::Tensor& weight() const { return weight_; }

 private:
  at::Tensor weight_;  // [dim]
  double eps_;
};

/// A "linear_attention" layer (Qwen3_5GatedDeltaNet). Its generation state is per sequence row: the conv's last
/// kernel - 1 inputs and the delta rule's [Hv, Dk, Dv] matrix (KvCacheView::conv_states / recurrent_states), so
/// prefill must know each row's real length (KvCacheView::lengths) and decoding is one recurrent step.
/// Tensor parallel: split by heads (key heads and their value heads together): in_proj_qkv and the conv take this
/// rank's heads of each of q, k and v, in_proj_z/b/a, A_log and dt_bias its value heads, out_proj its inputs; the
/// per-head norm weight is whole (its gradient partial) and the state rows hold this rank's heads.
class GatedDeltaNet : public AttentionModule {
 public:
  static constexpr int64_t kChunkSize = 64;  // transformers' default chunk

  /// HF names under `prefix` (e.g. "model.layers.0.linear_attn"): in_proj_qkv, in_proj_z, in_proj_b, in_proj_a,
  /// out_proj (LoRA-capable), conv1d.weight [conv_dim, 1, kernel], A_log [Hv], dt_bias [Hv], norm.weight [Dv].
  GatedDeltaNet(const ModelConfig& config, BuildContext& ctx, const std::string& prefix);
  /// x: [B, T, hidden] → [B, T, hidden]; cos/sin are unused, and of `mask` only a packed row's sequence starts,
  /// where the conv and the state restart (causal by construction; right padding never reaches an earlier real
  /// token). `cache`/`layer`: generation only.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const AttentionMask& mask,
                     const lora::AdapterSegments& segments, const KvCacheView* cache = nullptr,
                     int64_t layer = 0) const override;
  void collect_lora(const std::string& prefix, std::vector<NamedLoraModule>& out) override;
  void collect_parameters(const std::string& prefix, std::vector<NamedParameter>& out) const override;

 private:
  /// qkv: [B, T, conv_dim] → silu(causal depthwise conv) [B, T, conv_dim], reading/writing the cache's conv state.
  at::Tensor conv(const at::Tensor& qkv, const KvCacheView* cache, int64_t layer) const;

  const dist::TensorParallel& tp_;
  int64_t key_heads_, value_heads_, key_dim_, value_dim_, kernel_;  // heads: this rank's
  std::vector<int64_t> qkv_sections_;  // whole [q | k | v] widths of in_proj_qkv's output and the conv's channels
  lora::LoraLinear in_proj_qkv_, in_proj_z_, in_proj_b_, in_proj_a_, out_proj_;
  at::Tensor conv_weight_;  // [conv_dim, 1, kernel], conv_dim = 2 * Hk * Dk + Hv * Dv
  at::Tensor a_log_;        // [Hv]
  at::Tensor dt_bias_;      // [Hv]
  GatedRmsNorm norm_;
};

}  // namespace skyrl_tx::models
