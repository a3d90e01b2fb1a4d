// Tests optim::AdamState against a hand-written AdamW (decoupled decay, bias correction), clipping and validation.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cmath>
#include <string>
#include <vector>

#include "common/errors.h"
#include "optim/adamw.h"
#include "testing/tensor_asserts.h"
#include "testing/tiny_model.h"

namespace skyrl_tx::optim {
namespace {

using skyrl_tx::testing::make_gen;
using skyrl_tx::testing::randn;

// Plain AdamW on one tensor, in double: p ← p(1 − lr·wd); m, v moments; p ← p − lr·m̂/(√v̂ + eps).
struct ReferenceAdam {
  at::Tensor p, m, v;
  int64_t t = 0;
  explicit ReferenceAdam(const at::Tensor& param)
      : p(param.to(at::kDouble).clone()), m(at::zeros_like(p)), v(at::zeros_like(p)) {}
  void step(const at::Tensor& grad, const AdamParams& h) {
    ++t;
    at::Tensor g = grad.to(at::kDouble);
    p = p * (1.0 - h.learning_rate * h.weight_decay);
    m = h.beta1 * m + (1.0 - h.beta1) * g;
    v = h.beta2 * v + (1.0 - h.beta2) * g * g;
    at::Tensor m_hat = m / (1.0 - std::pow(h.beta1, static_cast<double>(t)));
    at::Tensor v_hat = v / (1.0 - std::pow(h.beta2, static_cast<double>(t)));
    p = p - h.learning_rate * m_hat / (at::sqrt(v_hat) + h.eps);
  }
};

AdamParams test_params() {
  AdamParams h;
  h.learning_rate = 0.01;
  h.beta1 = 0.9;
  h.beta2 = 0.99;
  h.eps = 1e-8;
  h.weight_decay = 0.1;
  return h;
}

TEST(AdamWTest, ThreeStepsMatchHandWrittenAdamW) {
  at::Generator gen = make_gen(1);
  at::Tensor a = randn({4, 3}, gen), b = randn({5}, gen);
  ReferenceAdam ref_a(a), ref_b(b);
  AdamState state;
  const AdamParams h = test_params();
  for (int step = 1; step <= 3; ++step) {
    at::Tensor ga = randn({4, 3}, gen), gb = randn({5}, gen, 0.5);
    auto metrics = state.step({{"a", a, ga}, {"b", b, gb}}, h);
    ref_a.step(ga, h);
    ref_b.step(gb, h);
    EXPECT_EQ(state.num_steps(), step);
    EXPECT_DOUBLE_EQ(metrics.at("step"), step);
    EXPECT_DOUBLE_EQ(metrics.at("learning_rate"), h.learning_rate);
    const double norm = std::sqrt(ga.to(at::kDouble).pow(2).sum().item<double>() + gb.to(at::kDouble).pow(2).sum().item<double>());
    EXPECT_NEAR(metrics.at("grad_norm"), norm, 1e-5);
    EXPECT_TENSOR_CLOSE(a, ref_a.p, 1e-5, 1e-6);
    EXPECT_TENSOR_CLOSE(b, ref_b.p, 1e-5, 1e-6);
  }
  ASSERT_EQ(state.moments().size(), 2u);
  EXPECT_TENSOR_CLOSE(state.moments().at("a").first, ref_a.m, 1e-5, 1e-7);
  EXPECT_TENSOR_CLOSE(state.moments().at("a").second, ref_a.v, 1e-5, 1e-8);
}

TEST(AdamWTest, ClippingScalesByMaxNormOverNormAndReportsPreClipNorm) {
  at::Generator gen = make_gen(2);
  at::Tensor a = randn({6}, gen), b = randn({2, 2}, gen);
  at::Tensor ga = randn({6}, gen, 3.0), gb = randn({2, 2}, gen, 3.0);
  const double norm = std::sqrt(ga.to(at::kDouble).pow(2).sum().item<double>() + gb.to(at::kDouble).pow(2).sum().item<double>());
  AdamParams h = test_params();
  h.grad_clip_norm = 0.5;
  ASSERT_GT(norm, h.grad_clip_norm);
  const double scale = h.grad_clip_norm / (norm + 1e-6);
  ReferenceAdam ref_a(a), ref_b(b);
  AdamState state;
  auto metrics = state.step({{"a", a, ga}, {"b", b, gb}}, h);
  EXPECT_NEAR(metrics.at("grad_norm"), norm, 1e-5);
  ref_a.step(ga.to(at::kDouble) * scale, h);
  ref_b.step(gb.to(at::kDouble) * scale, h);
  EXPECT_TENSOR_CLOSE(a, ref_a.p, 1e-5, 1e-6);
  EXPECT_TENSOR_CLOSE(b, ref_b.p, 1e-5, 1e-6);
  // The first moment holds (1 − β1)·scaled grad: proves the scale, not just the (scale-invariant) first step.
  EXPECT_TENSOR_CLOSE(state.moments().at("a").first, (1.0 - h.beta1) * scale * ga.to(at::kDouble), 1e-5, 1e-7);
}

TEST(AdamWTest, NormBelowMaxIsNotScaledUp) {
  at::Generator gen = make_gen(3);
  at::Tensor a = randn({5}, gen), ga = randn({5}, gen, 0.01);
  AdamParams h = test_params();
  h.grad_clip_norm = 100.0;
  AdamState state;
  state.step({{"a", a, ga}}, h);
  EXPECT_TENSOR_CLOSE(state.moments().at("a").first, (1.0 - h.beta1) * ga.to(at::kDouble), 1e-5, 1e-8);
}

TEST(AdamWTest, UndefinedGradIsZeros) {
  at::Generator gen = make_gen(4);
  at::Tensor a = randn({3, 2}, gen), b = randn({4}, gen);
  at::Tensor ga = randn({3, 2}, gen);
  AdamParams h = test_params();
  ReferenceAdam ref_a(a), ref_b(b);
  AdamState state;
  for (int step = 0; step < 2; ++step) {
    auto metrics = state.step({{"a", a, ga}, {"b", b, at::Tensor()}}, h);
    EXPECT_NEAR(metrics.at("grad_norm"), ga.to(at::kDouble).norm().item<double>(), 1e-5);
    ref_a.step(ga, h);
    ref_b.step(at::zeros({4}, at::kFloat), h);
  }
  EXPECT_TENSOR_CLOSE(a, ref_a.p, 1e-5, 1e-6);
  EXPECT_TENSOR_CLOSE(b, ref_b.p, 1e-5, 1e-7);  // only weight decay moved it
  EXPECT_TENSOR_EQ(state.moments().at("b").first, at::zeros({4}, at::kFloat));
}

TEST(AdamWTest, GlobalGradNormSkipsUndefinedGrads) {
  at::Tensor p = at::zeros({2});
  std::vector<TrainableTensor> ts = {{"x", p, at::tensor({3.0f, 0.0f})}, {"y", p, at::Tensor()},
                                     {"z", p, at::tensor({0.0f, 4.0f})}};
  EXPECT_DOUBLE_EQ(global_grad_norm(ts), 5.0);
}

TEST(AdamWTest, ValidateRejectsBadParams) {
  EXPECT_NO_THROW(AdamParams{}.validate());
  AdamParams lr;
  lr.learning_rate = -1e-3;
  EXPECT_THROW(lr.validate(), InvalidArgument);
  AdamParams beta1;
  beta1.beta1 = 1.0;
  EXPECT_THROW(beta1.validate(), InvalidArgument);
  AdamParams eps;
  eps.eps = -1e-8;
  EXPECT_THROW(eps.validate(), InvalidArgument);
  AdamParams beta2;
  beta2.beta2 = 1.5;
  EXPECT_THROW(beta2.validate(), InvalidArgument);
  AdamParams wd;
  wd.weight_decay = -0.1;
  EXPECT_THROW(wd.validate(), InvalidArgument);
}

TEST(AdamWTest, StepValidatesBeforeTouchingParams) {
  at::Tensor a = at::ones({3}), before = a.clone();
  AdamParams h;
  h.learning_rate = -1.0;
  AdamState state;
  EXPECT_THROW(state.step({{"a", a, at::ones({3})}}, h), InvalidArgument);
  EXPECT_TENSOR_EQ(a, before);
  EXPECT_EQ(state.num_steps(), 0);
}

}  // namespace
}  // namespace skyrl_tx::optim
