// Tests loss::elementwise_loss against plain-ATen formulas (values and gradients) and loss name/config parsing
// (the sequence-level losses: test_sequence_losses.cpp).
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "common/errors.h"
#include "loss/losses.h"
#include "testing/errors.h"
#include "testing/tensor_asserts.h"
#include "testing/tiny_model.h"

namespace skyrl_tx::loss {
namespace {

using skyrl_tx::testing::invalid_argument_message;
using skyrl_tx::testing::make_gen;
using skyrl_tx::testing::randn;

constexpr int64_t kN = 12;

// Random per-token inputs for one loss kind; clip range [0.9, 1.1] so some ratios are clipped.
LossInputs random_inputs(LossKind kind, uint64_t seed) {
  at::Generator gen = make_gen(seed);
  LossInputs in;
  in.kind = at::full({kN}, static_cast<int64_t>(kind), at::kLong);
  in.valid = at::ones({kN}, at::kBool);
  in.weights = at::rand({kN}, gen, at::kFloat) + 0.5;
  in.sampling_logprobs = -at::rand({kN}, gen, at::kFloat) * 2.0;
  in.advantages = randn({kN}, gen);
  in.clip_low = at::full({kN}, 0.9f, at::kFloat);
  in.clip_high = at::full({kN}, 1.1f, at::kFloat);
  in.beta = at::full({kN}, 0.3f, at::kFloat);
  in.ratio_mask = (at::rand({kN}, gen, at::kFloat) < 0.7).to(at::kFloat);
  in.seq_log_ratio = randn({kN}, gen, 0.2);  // gspo: as if filled by sequence_log_ratio
  return in;
}

// Target logprobs near q so that ratios fall on both sides of the clip range.
at::Tensor random_lp(const LossInputs& in, uint64_t seed) {
  at::Generator gen = make_gen(seed);
  return (in.sampling_logprobs + randn({kN}, gen, 0.3)).detach();
}

// The documented per-token formula of `kind`, written independently of the implementation.
at::Tensor reference(LossKind kind, const at::Tensor& lp, const LossInputs& in) {
  const at::Tensor& w = in.weights;
  const at::Tensor& q = in.sampling_logprobs;
  const at::Tensor& a = in.advantages;
  at::Tensor r = at::exp(lp - q);
  at::Tensor clipped = at::max(at::min(r, in.clip_high), in.clip_low);
  switch (kind) {
    case LossKind::kCrossEntropy:
      return -lp * w;
    case LossKind::kImportanceSampling:
      return -r * a * w;
    case LossKind::kPpo:
      return -at::min(r * a, clipped * a) * w;
    case LossKind::kCispo:
      return -clipped.detach() * lp * a * w;
    case LossKind::kDro:
      return -(lp * a - 0.5 * in.beta * (lp - q) * (lp - q)) * w;
    case LossKind::kGspo: {
      // s_t = sg(exp(S)) · p_t / sg(p_t), written as in the Tinker docs.
      at::Tensor s = at::exp(in.seq_log_ratio) * at::exp(lp) / at::exp(lp).detach();
      at::Tensor s_clipped = at::max(at::min(s, in.clip_high), in.clip_low);
      return -at::min(s * a, s_clipped * a) * w;
    }
    case LossKind::kStableReinforce:
      return (-a * lp + in.beta * (r - 1.0 - at::log(r))) * w;
  }
  return at::Tensor();
}

const LossKind kAllKinds[] = {LossKind::kCrossEntropy, LossKind::kImportanceSampling, LossKind::kPpo,
                              LossKind::kCispo, LossKind::kDro, LossKind::kGspo, LossKind::kStableReinforce};
constexpr int64_t kNumKinds = sizeof(kAllKinds) / sizeof(kAllKinds[0]);

TEST(LossTest, EachKindMatchesItsFormula) {
  uint64_t seed = 1;
  for (LossKind kind : kAllKinds) {
    SCOPED_TRACE(loss_name(kind));
    LossInputs in = random_inputs(kind, seed++);
    at::Tensor lp = random_lp(in, seed++);
    EXPECT_TENSOR_CLOSE(elementwise_loss(lp, in), reference(kind, lp, in), 1e-6, 1e-6);
  }
}

TEST(LossTest, PpoClipsBothSides) {
  LossInputs in = random_inputs(LossKind::kPpo, 3);
  // ratios 0.5 (below lo) and 2.0 (above hi) with positive and negative advantages.
  in.sampling_logprobs = at::zeros({4}, at::kFloat);
  in.advantages = at::tensor({1.0f, -1.0f, 1.0f, -1.0f});
  in.weights = at::ones({4}, at::kFloat);
  in.kind = in.kind.narrow(0, 0, 4);
  in.valid = in.valid.narrow(0, 0, 4);
  in.clip_low = at::full({4}, 0.8f, at::kFloat);
  in.clip_high = at::full({4}, 1.2f, at::kFloat);
  in.beta = in.beta.narrow(0, 0, 4);
  in.ratio_mask = in.ratio_mask.narrow(0, 0, 4);
  in.seq_log_ratio = in.seq_log_ratio.narrow(0, 0, 4);
  at::Tensor lp = at::log(at::tensor({0.5f, 0.5f, 2.0f, 2.0f}));
  // -min(r*A, clip(r)*A): (0.5, +) → -0.5; (0.5, -) → 0.8; (2, +) → -1.2; (2, -) → 2.
  EXPECT_TENSOR_CLOSE(elementwise_loss(lp, in), at::tensor({-0.5f, 0.8f, -1.2f, 2.0f}), 1e-5, 1e-6);
}

TEST(LossTest, MixedKindsInOneTensor) {
  LossInputs in = random_inputs(LossKind::kCrossEntropy, 11);
  at::Tensor kinds = at::arange(kN, at::kLong).remainder(kNumKinds);
  in.kind = kinds;
  at::Tensor lp = random_lp(in, 12);
  at::Tensor out = elementwise_loss(lp, in);
  for (int64_t i = 0; i < kN; ++i) {
    const LossKind kind = static_cast<LossKind>(kinds[i].item<int64_t>());
    SCOPED_TRACE(loss_name(kind));
    const double expected = reference(kind, lp, in)[i].item<double>();
    EXPECT_NEAR(out[i].item<double>(), expected, 1e-5);
  }
}

TEST(LossTest, InvalidTokensGiveZeroLossAndZeroGradient) {
  uint64_t seed = 20;
  for (LossKind kind : kAllKinds) {
    SCOPED_TRACE(loss_name(kind));
    LossInputs in = random_inputs(kind, seed++);
    in.valid = at::arange(kN, at::kLong).remainder(3) != 0;  // every third token invalid
    at::Tensor lp = random_lp(in, seed++).requires_grad_(true);
    at::Tensor out = elementwise_loss(lp, in);
    at::Tensor expected = at::where(in.valid, reference(kind, lp.detach(), in), at::zeros({kN}, at::kFloat));
    EXPECT_TENSOR_CLOSE(out.detach(), expected, 1e-6, 1e-6);
    at::Tensor invalid_out = out.detach().masked_select(in.valid.logical_not());
    EXPECT_TENSOR_EQ(invalid_out, at::zeros_like(invalid_out));
    out.sum().backward();
    at::Tensor invalid_grad = lp.grad().masked_select(in.valid.logical_not());
    EXPECT_TENSOR_EQ(invalid_grad, at::zeros_like(invalid_grad));
  }
}

TEST(LossTest, GradientMatchesAutogradOfTheFormula) {
  uint64_t seed = 40;
  for (LossKind kind : kAllKinds) {
    SCOPED_TRACE(loss_name(kind));
    LossInputs in = random_inputs(kind, seed++);
    at::Tensor base = random_lp(in, seed++);
    at::Tensor lp = base.clone().requires_grad_(true);
    elementwise_loss(lp, in).sum().backward();
    at::Tensor ref_lp = base.clone().requires_grad_(true);
    reference(kind, ref_lp, in).sum().backward();
    EXPECT_TENSOR_CLOSE(lp.grad(), ref_lp.grad(), 1e-5, 1e-6);
  }
}

TEST(LossTest, CispoGradientDoesNotFlowThroughTheRatio) {
  LossInputs in = random_inputs(LossKind::kCispo, 60);
  at::Tensor base = random_lp(in, 61);
  at::Tensor lp = base.clone().requires_grad_(true);
  elementwise_loss(lp, in).sum().backward();
  at::Tensor clip = at::clamp(at::exp(base - in.sampling_logprobs), 0.9, 1.1);
  EXPECT_TENSOR_CLOSE(lp.grad(), -clip * in.advantages * in.weights, 1e-5, 1e-6);
}

TEST(LossTest, CustomRowsBackpropagateTheirGraphsGradient) {
  // A custom-loss token carries g = dC/dlp (the micro-batch runner's pre-pass): its loss is g·lp, so d/dlp is g.
  LossInputs in = random_inputs(LossKind::kCrossEntropy, 11);
  const int64_t n = in.kind.numel();
  in.kind = at::full({n}, static_cast<int64_t>(LossKind::kCustom), at::kLong);
  in.custom_grad = at::randn({n}, at::TensorOptions().dtype(at::kFloat));
  at::Tensor lp = random_lp(in, 12).requires_grad_(true);
  at::Tensor loss = elementwise_loss(lp, in);
  EXPECT_TENSOR_CLOSE(loss, at::where(in.valid, lp * in.custom_grad, at::zeros_like(lp)), 1e-6, 1e-6);
  loss.sum().backward();
  EXPECT_TENSOR_CLOSE(lp.grad(), at::where(in.valid, in.custom_grad, at::zeros_like(lp)), 1e-6, 1e-6);
}

TEST(LossTest, ParseLossKindNamesEveryLoss) {
  EXPECT_EQ(parse_loss_kind("cross_entropy"), LossKind::kCrossEntropy);
  EXPECT_EQ(parse_loss_kind("importance_sampling"), LossKind::kImportanceSampling);
  EXPECT_EQ(parse_loss_kind("ppo"), LossKind::kPpo);
  EXPECT_EQ(parse_loss_kind("cispo"), LossKind::kCispo);
  EXPECT_EQ(parse_loss_kind("dro"), LossKind::kDro);
  EXPECT_EQ(parse_loss_kind("gspo"), LossKind::kGspo);
  EXPECT_EQ(parse_loss_kind("stable_reinforce"), LossKind::kStableReinforce);
  EXPECT_EQ(parse_loss_kind("custom"), LossKind::kCustom);  // a create_custom_loss graph (loss/custom_loss.h)
  for (LossKind kind : kAllKinds) EXPECT_EQ(parse_loss_kind(loss_name(kind)), kind);
  EXPECT_THROW(parse_loss_kind("grpo"), InvalidArgument);
  EXPECT_THROW(parse_loss_kind(""), InvalidArgument);
}

TEST(LossTest, ParseLossConfigDefaults) {
  LossConfig ppo = parse_loss_config(LossKind::kPpo, {});
  EXPECT_DOUBLE_EQ(ppo.clip_low, 0.8);
  EXPECT_DOUBLE_EQ(ppo.clip_high, 1.2);
  LossConfig cispo = parse_loss_config(LossKind::kCispo, {});
  EXPECT_DOUBLE_EQ(cispo.clip_low, 0.0);
  EXPECT_DOUBLE_EQ(cispo.clip_high, 4.0);
  LossConfig dro = parse_loss_config(LossKind::kDro, {});
  EXPECT_DOUBLE_EQ(dro.beta, 0.01);
  LossConfig overridden = parse_loss_config(LossKind::kPpo, {{"clip_low_threshold", 0.5}, {"clip_high_threshold", 2.0}});
  EXPECT_DOUBLE_EQ(overridden.clip_low, 0.5);
  EXPECT_DOUBLE_EQ(overridden.clip_high, 2.0);
  EXPECT_DOUBLE_EQ(parse_loss_config(LossKind::kDro, {{"beta", 0.25}}).beta, 0.25);
  LossConfig gspo = parse_loss_config(LossKind::kGspo, {});
  EXPECT_DOUBLE_EQ(gspo.clip_low, 0.8);
  EXPECT_DOUBLE_EQ(gspo.clip_high, 1.2);
  // The GSPO paper's tight sequence-level range (1 − 3e-4, 1 + 4e-4) is a config away.
  LossConfig gspo_tight =
      parse_loss_config(LossKind::kGspo, {{"clip_low_threshold", 0.9997}, {"clip_high_threshold", 1.0004}});
  EXPECT_DOUBLE_EQ(gspo_tight.clip_low, 0.9997);
  EXPECT_DOUBLE_EQ(gspo_tight.clip_high, 1.0004);
  EXPECT_DOUBLE_EQ(parse_loss_config(LossKind::kStableReinforce, {}).beta, 0.01);
  EXPECT_DOUBLE_EQ(parse_loss_config(LossKind::kStableReinforce, {{"kl_coeff", 0.0}}).beta, 0.0);
  EXPECT_DOUBLE_EQ(parse_loss_config(LossKind::kStableReinforce, {{"kl_coeff", 0.2}}).beta, 0.2);
}

TEST(LossTest, NewLossConfigErrorsNameTheKey) {
  // stable_reinforce's coefficient is kl_coeff, not dro's beta; gspo takes only the clip thresholds.
  EXPECT_NE(invalid_argument_message([] { parse_loss_config(LossKind::kStableReinforce, {{"beta", 0.1}}); })
                .find("'beta'"), std::string::npos);
  EXPECT_NE(invalid_argument_message([] { parse_loss_config(LossKind::kStableReinforce, {{"kl_coeff", -1.0}}); })
                .find("kl_coeff"), std::string::npos);
  EXPECT_NE(invalid_argument_message([] { parse_loss_config(LossKind::kGspo, {{"kl_coeff", 0.1}}); })
                .find("kl_coeff"), std::string::npos);
  EXPECT_THROW(parse_loss_config(LossKind::kGspo, {{"clip_low_threshold", 1.5}}), InvalidArgument);
}

TEST(LossTest, NewLossInputs) {
  const std::vector<std::string> policy = {"target_tokens", "logprobs", "advantages"};
  EXPECT_EQ(required_inputs(LossKind::kGspo), policy);
  EXPECT_EQ(required_inputs(LossKind::kStableReinforce), policy);
  const auto& gspo = optional_inputs(LossKind::kGspo);
  EXPECT_NE(std::find(gspo.begin(), gspo.end(), "sequence_ratio_mask"), gspo.end());
  EXPECT_EQ(optional_inputs(LossKind::kStableReinforce), std::vector<std::string>{"weights"});
}

TEST(LossTest, StableReinforceIsReinforcePlusSamplerKl) {
  LossInputs in = random_inputs(LossKind::kStableReinforce, 80);
  at::Tensor base = random_lp(in, 81);
  at::Tensor lp = base.clone().requires_grad_(true);
  elementwise_loss(lp, in).sum().backward();
  // d/dlp [-A·lp + κ(r − 1 − log r)] = -A + κ(r − 1): no importance weight on the policy-gradient term.
  at::Tensor r = at::exp(base - in.sampling_logprobs);
  EXPECT_TENSOR_CLOSE(lp.grad(), (-in.advantages + in.beta * (r - 1.0)) * in.weights, 1e-5, 1e-6);
  // On-policy (lp = q) the KL term vanishes in value and gradient: plain REINFORCE.
  at::Tensor on = in.sampling_logprobs.clone().requires_grad_(true);
  at::Tensor loss = elementwise_loss(on, in);
  EXPECT_TENSOR_CLOSE(loss.detach(), -in.advantages * in.sampling_logprobs * in.weights, 1e-6, 1e-6);
  loss.sum().backward();
  EXPECT_TENSOR_CLOSE(on.grad(), -in.advantages * in.weights, 1e-6, 1e-6);
}

TEST(LossTest, ParseLossConfigUnknownKeyNamesTheKey) {
  try {
    parse_loss_config(LossKind::kPpo, {{"clip_epsilon", 0.2}});
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(e.message().find("clip_epsilon"), std::string::npos) << e.message();
  }
  try {
    parse_loss_config(LossKind::kCrossEntropy, {{"beta", 0.1}});
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(e.message().find("beta"), std::string::npos) << e.message();
  }
}

TEST(LossTest, ParseLossConfigRejectsInvertedClipRange) {
  EXPECT_THROW(parse_loss_config(LossKind::kPpo, {{"clip_low_threshold", 1.5}}), InvalidArgument);
  EXPECT_THROW(parse_loss_config(LossKind::kCispo, {{"clip_low_threshold", 2.0}, {"clip_high_threshold", 1.0}}),
               InvalidArgument);
  EXPECT_NO_THROW(parse_loss_config(LossKind::kCispo, {{"clip_low_threshold", 1.0}, {"clip_high_threshold", 1.0}}));
}

}  // namespace
}  // namespace skyrl_tx::loss
