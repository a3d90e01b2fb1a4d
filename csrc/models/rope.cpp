// Rotary position embedding (HF "rotate_half" convention), with Llama 3.1+ frequency scaling.
#include "models/rope.h"

#include <cmath>

namespace skyrl_tx::models {
namespace {

// Llama 3.1 scaling: long wavelengths divided by `factor`, short ones kept, a smooth blend between
// (transformers' _compute_llama3_parameters; Meta's llama-models reference implementation).
at::Tensor llama3_scale(const at::Tensor& inv_freq, const RopeScaling& s) {
  const double old_len = static_cast<double>(s.original_max_position_embeddings);
  const double low_freq_wavelen = old_len / s.low_freq_factor;
  const double high_freq_wavelen = old_len / s.high_freq_factor;
  at::Tensor wavelen = 2 * M_PI / inv_freq;
  at::Tensor scaled = at::where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq);
  at::Tensor smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
  at::Tensor smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled;
  at::Tensor is_medium = (wavelen >= high_freq_wavelen).logical_and(wavelen <= low_freq_wavelen);
  return at::where(is_medium, smoothed, scaled);
}

}  // namespace

RotaryEmbedding::RotaryEmbedding(const ModelConfig& config, at::Device device) {
  const int64_t dim = config.resolved_head_dim();
  // inv_freq: [dim / 2] = 1 / theta^(2i / dim), computed in float32 exactly as transformers does.
  at::Tensor exponent = at::arange(0, dim, 2, at::kLong).to(at::kFloat) / static_cast<double>(dim);
  inv_freq_ = 1.0 / at::pow(config.rope_theta, exponent);
  if (config.rope_scaling.type == "llama3") inv_freq_ = llama3_scale(inv_freq_, config.rope_scaling);
  inv_freq_ = inv_freq_.to(device);
}

std::pair<at::Tensor, at::Tensor> RotaryEmbedding::cos_sin(const at::Tensor& positions, at::ScalarType dtype) const {
  at::Tensor inv_freq = inv_freq_.to(positions.device());  // a no-op on the model's own device
  // freqs: [B, T, dim / 2]; emb: [B, T, dim]
  at::Tensor freqs = positions.to(at::kFloat).unsqueeze(-1) * inv_freq;
  at::Tensor emb = at::cat({freqs, freqs}, -1);
  return {emb.cos().to(dtype), emb.sin().to(dtype)};
}

at::Tensor RotaryEmbedding::apply(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  at::Tensor x1 = x.narrow(-1, 0, half);
  at::Tensor x2 = x.narrow(-1, half, half);
  at::Tensor rotated = at::cat({-x2, x1}, -1);
  // cos/sin: [B, 1, T, dim] broadcast over heads
  return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1);
}

}  // namespace skyrl_tx::models
