// Tinker's loss functions: per-token losses summed over tokens, with their inputs and config keys.
#include "loss/losses.h"

#include <algorithm>

#include "common/errors.h"

namespace skyrl_tx::loss {
namespace {

const std::vector<std::string> kLossNames = {"cross_entropy", "importance_sampling", "ppo", "cispo", "dro"};

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) out += (i ? ", " : "") + items[i];
  return out;
}

}  // namespace

LossKind parse_loss_kind(const std::string& name) {
  auto it = std::find(kLossNames.begin(), kLossNames.end(), name);
  SKYRL_TX_CHECK(it != kLossNames.end(), InvalidArgument, "forward_backward: loss_fn '", name,
                 "' is not supported; use one of ", join(kLossNames));
  return static_cast<LossKind>(it - kLossNames.begin());
}

const char* loss_name(LossKind kind) { return kLossNames.at(static_cast<size_t>(kind)).c_str(); }

LossConfig parse_loss_config(LossKind kind, const std::map<std::string, double>& config) {
  LossConfig out;
  std::vector<std::string> allowed;
  if (kind == LossKind::kPpo) {
    out.clip_low = 0.8, out.clip_high = 1.2;
    allowed = {"clip_low_threshold", "clip_high_threshold"};
  } else if (kind == LossKind::kCispo) {
    // One-sided by default: only the upper side is capped (MiniMax-M1; ScaleRL uses clip(r, 0, eps_max)).
    out.clip_low = 0.0, out.clip_high = 4.0;
    allowed = {"clip_low_threshold", "clip_high_threshold"};
  } else if (kind == LossKind::kDro) {
    out.beta = 0.01;
    allowed = {"beta"};
  }
  for (const auto& [key, value] : config) {
    SKYRL_TX_CHECK(std::find(allowed.begin(), allowed.end(), key) != allowed.end(), InvalidArgument,
                   "forward_backward: loss_fn_config key '", key, "' is not used by loss '", loss_name(kind), "'",
                   allowed.empty() ? std::string("; it takes no config") : "; valid keys: " + join(allowed));
    if (key == "clip_low_threshold") out.clip_low = value;
    if (key == "clip_high_threshold") out.clip_high = value;
    if (key == "beta") out.beta = value;
  }
  SKYRL_TX_CHECK(out.clip_low <= out.clip_high, InvalidArgument, "forward_backward: clip_low_threshold (",
                 out.clip_low, ") must not exceed clip_high_threshold (", out.clip_high, ")");
  SKYRL_TX_CHECK(out.beta >= 0, InvalidArgument, "forward_backward: beta must be >= 0 (got ", out.beta, ")");
  return out;
}

const std::vector<std::string>& required_inputs(LossKind kind) {
  static const std::vector<std::string> kSupervised = {"target_tokens", "weights"};
  static const std::vector<std::string> kPolicy = {"target_tokens", "logprobs", "advantages"};
  return kind == LossKind::kCrossEntropy ? kSupervised : kPolicy;
}

const std::vector<std::string>& optional_inputs(LossKind kind) {
  static const std::vector<std::string> kNone = {};
  static const std::vector<std::string> kWeights = {"weights"};
  static const std::vector<std::string> kClipped = {"weights", "clip_low_threshold", "clip_high_threshold"};
  if (kind == LossKind::kCrossEntropy) return kNone;
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
  return at::where(in.valid, loss, at::zeros_like(loss));
}

}  // namespace skyrl_tx::loss
