// MlaAttention: DeepSeek's multi-head latent attention; the KV cache holds the compressed latent, not K and V.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

#include "models/layers.h"

namespace skyrl_tx::models {

/// q: (q_a_proj → q_a_layernorm → q_b_proj) or q_proj, per head [nope | rope]. kv_a_proj_with_mqa gives a latent
/// [kv_lora_rank] (normalised by kv_a_layernorm) and one shared RoPE key [qk_rope_head_dim]; kv_b_proj expands the
/// latent to per-head [k_nope | v]. Generation caches latent + rotated RoPE key per token (kv_lora_rank +
/// qk_rope_head_dim values) and expands the cached latents at every step (DeepSeek-AI 2024, "DeepSeek-V2", sec. 2.1).
/// Tensor parallel: q_proj / q_b_proj and kv_b_proj are split by heads (column-parallel), o_proj by their inputs
/// (row-parallel); the low-rank q_a / kv_a projections, their norms and the cached latent stay whole on every rank,
/// each rank expanding the latent into its own heads (so their gradients are partial: summed over the group).
class MlaAttention : public AttentionModule {
 public:
  MlaAttention(const ModelConfig& config, BuildContext& ctx, const std::string& prefix);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const AttentionMask& mask,
                     const lora::AdapterSegments& segments, const KvCacheView* cache = nullptr,
                     int64_t layer = 0) const override;
  void collect_lora(const std::string& prefix, std::vector<NamedLoraModule>& out) override;
  void collect_parameters(const std::string& prefix, std::vector<NamedParameter>& out) const override;

 private:
  const dist::TensorParallel& tp_;
  int64_t heads_, kv_lora_rank_, nope_, rope_, v_dim_;  // heads_: this rank's
  bool interleave_;
  double scale_;  // qk_head_dim^-0.5, times YaRN's mscale^2
  std::unique_ptr<lora::LoraLinear> q_proj_, q_a_proj_, q_b_proj_;  // q_proj, or q_a/q_b with q_a_norm_
  std::unique_ptr<RmsNorm> q_a_norm_;
  at::Tensor o_bias_;  // tensor parallel with a bias: o_proj's, added once after the sum (before o_proj_: it sets it)
  lora::LoraLinear kv_a_proj_, kv_b_proj_, o_proj_;
  RmsNorm kv_a_norm_;

  at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) const;
  /// latent [B, L, kv_lora_rank], k_rot [B, 1, L, rope] → K [B, heads, L, nope + rope], V [B, heads, L, v].
  /// `segments` covers the B * L latent rows.
  std::pair<at::Tensor, at::Tensor> expand(const at::Tensor& latent, const at::Tensor& k_rot,
                                           const lora::AdapterSegments& segments) const;
  /// One decode step against the cached entries without expanding them: query [B, heads, 1, nope + rope], past
  /// [B, 1, L, kv_lora_rank + rope], attend_mask bool [B, 1, 1, L], `segments` one token per row → [B, heads, 1, v].
  at::Tensor absorbed_decode(const at::Tensor& query, const at::Tensor& past, const at::Tensor& attend_mask,
                             const lora::AdapterSegments& segments) const;
};

}  // namespace skyrl_tx::models
