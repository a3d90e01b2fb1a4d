// Rotary position embedding (HF "rotate_half" and DeepSeek's interleaved conventions), Llama 3.1+ and YaRN scaling.
#pragma once

#include <ATen/ATen.h>

#include <utility>

#include "models/model_config.h"

namespace skyrl_tx::models {

class RotaryEmbedding {
 public:
  /// inv_freq is computed on the CPU (bit-identical on every device), then kept on `device`: a per-call copy
  /// would be a host-to-device transfer inside every forward (and is not allowed in a CUDA graph capture).
  explicit RotaryEmbedding(const ModelConfig& config, at::Device device = at::kCPU);

  /// positions: int64 [B, T] → (cos, sin), each [B, T, rotary_dim] in `dtype` (rotary_dim = head_dim unless partial).
  std::pair<at::Tensor, at::Tensor> cos_sin(const at::Tensor& positions, at::ScalarType dtype) const;
  /// x: [B, heads, T, head_dim]; cos/sin: [B, T, rotary_dim]. Returns x rotated (dims past rotary_dim unchanged).
  static at::Tensor apply(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
  /// DeepSeek's interleaved pairs (x0, x1), (x2, x3), ...; the result is laid out de-interleaved, [evens | odds]
  /// rotated (transformers' apply_rotary_pos_emb_interleave).
  static at::Tensor apply_interleaved(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
  /// YaRN's cos/sin multiplier (1 otherwise).
  double attention_factor() const { return attention_factor_; }

  const at::Tensor& inv_freq() const { return inv_freq_; }

 private:
  at::Tensor inv_freq_;  // [rotary_dim / 2], float32, on the model's device
  double attention_factor_ = 1.0;
};

}  // namespace skyrl_tx::models
