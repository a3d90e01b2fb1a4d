// Tinker's loss functions: per-token losses summed over tokens, with their inputs and config keys.
//
// gspo (https://tinker-docs.thinkingmachines.ai/tinker/losses/gspo/; Zheng et al. 2025, arXiv 2507.18071):
// Tinker's token-level variant, GSPO-token. Per datum, over the tokens M where sequence_ratio_mask != 0,
//   S   = mean_{t in M} (lp_t − q_t)                       (log of the geometric mean of the token ratios)
//   s_t = sg(exp(S)) · p(x_t) / sg(p(x_t)) = exp(sg(S) + lp_t − sg(lp_t))   (value exp(S), gradient of lp_t)
//   L   = −Σ_t min(s_t·A_t, clip(s_t, lo, hi)·A_t) · w_t
// loss_fn_inputs: target_tokens, logprobs (q), advantages (A) required; sequence_ratio_mask, weights (w, default
// 1) and per-token clip_low/high_threshold optional. The docs define M only by sequence_ratio_mask (the cookbook's
// rl_loop sends it over the sampled tokens); without it M = tokens with A != 0 and w != 0, which is the same set
// for prompt-padded RL data. An empty M gives S = 0 (ratio 1) rather than NaN.
// loss_fn_config: clip_low_threshold (default 0.8), clip_high_threshold (default 1.2): the docs write the clip
// as (1 − ε_low, 1 + ε_high) exactly as on the PPO page, whose ε are "fixed to 0.2", so PPO's keys and defaults.
//
// stable_reinforce (https://tinker-docs.thinkingmachines.ai/tinker/losses/stable-reinforce/, tinker-cookbook
// 0.6.1 CHANGELOG): "a REINFORCE variant that stays stable even when the sampling policy differs from the
// policy being trained", plus "a small sampler KL term by default (kl_coeff=0.01 in loss_fn_config)". Its exact
// objective is not published and it also reads per-sequence "stability info" the sampler records (the datum's
// provenance spans name it); this server records none, so it implements the published description with what
// a datum carries:
//   L = Σ_t (−A_t·lp_t + κ·(r_t − 1 − (lp_t − q_t))) · w_t,   r_t = exp(lp_t − q_t),  κ = kl_coeff
// REINFORCE has no importance weight, so an off-policy q never scales the gradient; the KL term is Schulman's
// k3 estimate of KL(q ‖ p) on the sampler's own tokens (unbiased under x ~ q, gradient (r − 1)·∇lp pulls p
// back toward the sampler). loss_fn_inputs as importance_sampling (target_tokens, logprobs, advantages;
// weights optional); loss_fn_config: kl_coeff (default 0.01, >= 0).
#include "loss/losses.h"

#include <algorithm>

#include "common/errors.h"

namespace skyrl_tx::loss {
namespace {

// Indexed by LossKind.
const std::vector<std::string> kLossNames = {"cross_entropy", "importance_sampling", "ppo", "cispo", "dro",
                                             "gspo", "stable_reinforce", "custom"};

}  // namespace

LossKind parse_loss_kind(const std::string& name) {
  auto it = std::find(kLossNames.begin(), kLossNames.end(), name);
  SKYRL_TX_CHECK(it != kLossNames.end(), InvalidArgument, "forward_backward: loss_fn '", name,
                 "' is not supported; use one of ", join_with_commas(kLossNames));
  return static_cast<LossKind>(it - kLossNames.begin());
}

const char* loss_name(LossKind kind) { return kLossNames.at(static_cast<size_t>(kind)).c_str(); }

LossConfig parse_loss_config(LossKind kind, const std::map<std::string, double>& config) {
  LossConfig out;
  std::vector<std::string> allowed;
  if (kind == LossKind::kPpo || kind == LossKind::kGspo) {
    out.clip_low = 0.8, out.clip_high = 1.2;
    allowed = {"clip_low_threshold", "clip_high_threshold"};
  } else if (kind == LossKind::kCispo) {
    // One-sided by default: only the upper side is capped (MiniMax-M1; ScaleRL uses clip(r, 0, eps_max)).
    out.clip_low = 0.0, out.clip_high = 4.0;
    allowed = {"clip_low_threshold", "clip_high_threshold"};
  } else if (kind == LossKind::kDro) {
    out.beta = 0.01;
    allowed = {"beta"};
  } else if (kind == LossKind::kStableReinforce) {
    out.beta = 0.01;
    allowed = {"kl_coeff"};
  }
  for (const auto& [key, value] : config) {
    SKYRL_TX_CHECK(std::find(allowed.begin(), allowed.end(), key) != allowed.end(), InvalidArgument,
                   "forward_backward: loss_fn_config key '", key, "' is not used by loss '", loss_name(kind), "'",
                   allowed.empty() ? std::string("; it takes no config") : "; valid keys: " + join_with_commas(allowed));
    if (key == "clip_low_threshold") out.clip_low = value;
    if (key == "clip_high_threshold") out.clip_high = value;
    if (key == "beta" || key == "kl_coeff") out.beta = value;
  }
  SKYRL_TX_CHECK(out.clip_low <= out.clip_high, InvalidArgument, "forward_backward: clip_low_threshold (",
                 out.clip_low, ") must not exceed clip_high_threshold (", out.clip_high, ")");
  SKYRL_TX_CHECK(out.beta >= 0, InvalidArgument, "forward_backward: ",
                 kind == LossKind::kStableReinforce ? "kl_coeff" : "beta", " must be >= 0 (got ", out.beta, ")");
  return out;
}

const std::vector<std::string>& required_inputs(LossKind kind) {
  static const std::vector<std::string> kSupervised = {"target_tokens", "weights"};
  static const std::vector<std::string> kPolicy = {"target_tokens", "logprobs", "advantages"};
  static const std::vector<std::string> kTargets = {"target_tokens"};  // custom: its graph names the rest
  if (kind == LossKind::kCustom) return kTargets;
  return kind == LossKind::kCrossEntropy ? kSupervised : kPolicy;
}

const std::vector<std::string>& optional_inputs(LossKind kind) {
  static const std::vector<std::string> kNone = {};
  static const std::vector<std::string> kWeights = {"weights"};
  static const std::vector<std::string> kClipped = {"weights", "clip_low_threshold", "clip_high_threshold"};
  static const std::vector<std::string> kGspo = {"weights", "clip_low_threshold", "clip_high_threshold",
                                                 "sequence_ratio_mask"};
  if (kind == LossKind::kCrossEntropy) return kNone;
  if (kind == LossKind::kGspo) return kGspo;
  return (kind == LossKind::kPpo || kind == LossKind::kCispo) ? kClipped : kWeights;
}

at::Tensor elementwise_loss(const at::Tensor& lp, const LossInputs& in) {
  const at::Tensor& w = in.weights;
  const at::Tensor& q = in.sampling_logprobs;
  const at::Tensor& adv = in.advantages;
  // Padding and non-policy rows carry q = 0, so r stays finite; where() (not a product) keeps any
  // inf of an unselected branch out of the result and out of the gradient.
  at::Tensor ratio = at::exp(lp - q);
  at::Tensor clipped = at::clamp(ratio, in.clip_low, in.clip_high);
  at::Tensor kind = in.kind;
  at::Tensor loss = at::zeros_like(lp);
  loss = at::where(kind == static_cast<int64_t>(LossKind::kCrossEntropy), -lp * w, loss);
  loss = at::where(kind == static_cast<int64_t>(LossKind::kImportanceSampling), -ratio * adv * w, loss);
  loss = at::where(kind == static_cast<int64_t>(LossKind::kPpo), -at::minimum(ratio * adv, clipped * adv) * w, loss);
  loss = at::where(kind == static_cast<int64_t>(LossKind::kCispo), -clipped.detach() * lp * adv * w, loss);
  loss = at::where(kind == static_cast<int64_t>(LossKind::kDro),
                   -(lp * adv - 0.5 * in.beta * (lp - q).pow(2)) * w, loss);
  // GSPO-token: every token's ratio has its datum's value exp(S) and the gradient of its own lp.
  at::Tensor seq = in.seq_log_ratio.defined() ? in.seq_log_ratio : at::zeros_like(lp);
  at::Tensor seq_ratio = at::exp(seq + lp - lp.detach());
  at::Tensor seq_clipped = at::clamp(seq_ratio, in.clip_low, in.clip_high);
  loss = at::where(kind == static_cast<int64_t>(LossKind::kGspo),
                   -at::minimum(seq_ratio * adv, seq_clipped * adv) * w, loss);
  loss = at::where(kind == static_cast<int64_t>(LossKind::kStableReinforce),
                   (-adv * lp + in.beta * (ratio - 1.0 - (lp - q))) * w, loss);
  if (in.custom_grad.defined())
    loss = at::where(kind == static_cast<int64_t>(LossKind::kCustom), lp * in.custom_grad, loss);
  return at::where(in.valid, loss, at::zeros_like(loss));
}

at::Tensor sequence_log_ratio(const at::Tensor& lp, const LossInputs& in, const at::Tensor& token_datum,
                              int64_t num_data) {
  at::Tensor mask = (in.ratio_mask != 0).logical_and(in.valid).to(at::kFloat);  // [N]; padding has mask 0
  at::Tensor diff = lp.detach() - in.sampling_logprobs;                           // [N]
  // where(), not a product: a non-finite lp − q on a token outside M stays out of the sum.
  at::Tensor masked = at::where(mask > 0, diff, at::zeros_like(diff));
  at::Tensor total = at::zeros({num_data}, diff.options()).index_add_(0, token_datum, masked);  // [data]
  at::Tensor count = at::zeros({num_data}, diff.options()).index_add_(0, token_datum, mask);    // [data]
  at::Tensor mean = at::where(count > 0, total / count.clamp_min(1.0), at::zeros_like(total));  // [data]
  return mean.index_select(0, token_datum);  // [N]
}

}  // namespace skyrl_tx::loss
