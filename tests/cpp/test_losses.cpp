// Tests loss::elementwise_loss against plain-ATen formulas (values and gradients) and loss name/config parsing.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <map>
#include <string>

#include "common/errors.h"
#include "loss/losses.h"
#include "testing/tensor_asserts.h"
#include "testing/tiny_model.h"

namespace skyrl_tx::loss {
namespace {

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
  }
  return at::Tensor();
}

const LossKind kAllKinds[] = {LossKind::kCrossEntropy, LossKind::kImportanceSampling, LossKind::kPpo,
                              LossKind::kCispo, LossKind::kDro};

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
  at::Tensor lp = at::log(at::tensor({0.5f, 0.5f, 2.0f, 2.0f}));
  // -min(r*A, clip(r)*A): (0.5, +) → -0.5; (0.5, -) → 0.8; (2, +) → -1.2; (2, -) → 2.
  EXPECT_TENSOR_CLOSE(elementwise_loss(lp, in), at::tensor({-0.5f, 0.8f, -1.2f, 2.0f}), 1e-5, 1e-6);
}

TEST(LossTest, MixedKindsInOneTensor) {
  LossInputs in = random_inputs(LossKind::kCrossEntropy, 11);
  at::Tensor kinds = at::arange(kN, at::kLong).remainder(5);
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

TEST(LossTest, ParseLossKindNamesEveryLoss) {
  EXPECT_EQ(parse_loss_kind("cross_entropy"), LossKind::kCrossEntropy);
  EXPECT_EQ(parse_loss_kind("importance_sampling"), LossKind::kImportanceSampling);
  EXPECT_EQ(parse_loss_kind("ppo"), LossKind::kPpo);
  EXPECT_EQ(parse_loss_kind("cispo"), LossKind::kCispo);
  EXPECT_EQ(parse_loss_kind("dro"), LossKind::kDro);
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
