// Rotary position embedding (HF "rotate_half" and DeepSeek's interleaved conventions), Llama 3.1+ and YaRN scaling.
#include "models/rope.h"

#include <algorithm>
#include <cmath>

#include "ops/rope_cpu.h"

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

double yarn_mscale(double scale, double mscale) { return scale <= 1 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0; }

// YaRN (Peng et al. 2023): interpolated frequencies for long wavelengths, original ones for short, a linear ramp
// between (transformers' _compute_yarn_parameters, truncate = true).
at::Tensor yarn_scale(const at::Tensor& inv_freq, int64_t dim, double base, const RopeScaling& s) {
  auto correction_dim = [&](double rotations) {
    return (dim * std::log(s.original_max_position_embeddings / (rotations * 2 * M_PI))) / (2 * std::log(base));
  };
  const double low = std::max(std::floor(correction_dim(s.beta_fast)), 0.0);
  double high = std::min(std::ceil(correction_dim(s.beta_slow)), static_cast<double>(dim - 1));
  if (low == high) high += 0.001;  // prevent a singular ramp
  at::Tensor ramp = ((at::arange(dim / 2, at::kFloat) - low) / (high - low)).clamp(0, 1);
  at::Tensor extrapolation_factor = 1 - ramp;
  at::Tensor interpolated = inv_freq / s.factor;
  return interpolated * (1 - extrapolation_factor) + inv_freq * extrapolation_factor;
}

double yarn_attention_factor(const RopeScaling& s) {
  if (s.attention_factor > 0) return s.attention_factor;
  if (s.mscale != 0 && s.mscale_all_dim != 0) return yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim);
  return yarn_mscale(s.factor, 1.0);
}

}  // namespace

RotaryEmbedding::RotaryEmbedding(const ModelConfig& config, at::Device device) {
  const int64_t dim = config.rotary_dim();  // head_dim unless partial_rotary_factor < 1
  // inv_freq: [dim / 2] = 1 / theta^(2i / dim), computed in float32 exactly as transformers does.
  at::Tensor exponent = at::arange(0, dim, 2, at::kLong).to(at::kFloat) / static_cast<double>(dim);
  inv_freq_ = 1.0 / at::pow(config.rope_theta, exponent);
  if (config.rope_scaling.type == "llama3") inv_freq_ = llama3_scale(inv_freq_, config.rope_scaling);
  if (config.rope_scaling.type == "yarn") {
    inv_freq_ = yarn_scale(inv_freq_, dim, config.rope_theta, config.rope_scaling);
    attention_factor_ = yarn_attention_factor(config.rope_scaling);
  }
  inv_freq_ = inv_freq_.to(device);
}

std::pair<at::Tensor, at::Tensor> RotaryEmbedding::cos_sin(const at::Tensor& positions, at::ScalarType dtype) const {
  at::Tensor inv_freq = inv_freq_.to(positions.device());  // a no-op on the model's own device
  // freqs: [B, T, dim / 2]; emb: [B, T, dim]
  at::Tensor freqs = positions.to(at::kFloat).unsqueeze(-1) * inv_freq;
  at::Tensor emb = at::cat({freqs, freqs}, -1);
  if (attention_factor_ != 1.0) return {(emb.cos() * attention_factor_).to(dtype), (emb.sin() * attention_factor_).to(dtype)};
  return {emb.cos().to(dtype), emb.sin().to(dtype)};
}

at::Tensor RotaryEmbedding::apply(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  if (cos.size(-1) < x.size(-1)) {  // partial rotary (Qwen3.5): rotate the first dims, pass the rest through
    const int64_t rotary = cos.size(-1);
    return at::cat({apply(x.narrow(-1, 0, rotary), cos, sin), x.narrow(-1, rotary, x.size(-1) - rotary)}, -1);
  }
  if (ops::rope_cpu_applies(x, cos, sin)) return ops::rope_cpu(x, cos, sin);
  const int64_t half = x.size(-1) / 2;
  at::Tensor x1 = x.narrow(-1, 0, half);
  at::Tensor x2 = x.narrow(-1, half, half);
  at::Tensor rotated = at::cat({-x2, x1}, -1);
  // cos/sin: [B, 1, T, dim] broadcast over heads
  return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1);
}

at::Tensor RotaryEmbedding::apply_interleaved(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  using at::indexing::Slice;
  const int64_t half = x.size(-1) / 2;
  at::Tensor c = cos.narrow(-1, 0, half).unsqueeze(1), s = sin.narrow(-1, 0, half).unsqueeze(1);  // [B, 1, T, D/2]
  at::Tensor x1 = x.index({"...", Slice(0, at::indexing::None, 2)});
  at::Tensor x2 = x.index({"...", Slice(1, at::indexing::None, 2)});
  return at::cat({x1 * c - x2 * s, x2 * c + x1 * s}, -1);
}

}  // namespace skyrl_tx::models
