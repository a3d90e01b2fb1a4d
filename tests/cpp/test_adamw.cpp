// Tests optim::AdamState against a hand-written AdamW (decoupled decay, bias correction), clipping and validation.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cmath>
#include <map>
#include <string>
#include <utility>
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

// bf16 weights in [0.07, 0.12) (a bf16 ulp there is 2^-11 ≈ 4.9e-4) and a constant gradient: every AdamW step moves
// a weight by lr = 1e-5 (m̂/√v̂ = ±1), far below half an ulp, so a step that casts its float32 result back into the
// weight loses it. With float32 master weights, 200 steps move each weight by 200·lr = 2e-3 (about 4 ulps) as a
// float32 run does: the bf16 weights equal that run's final values rounded to bf16.
TEST(AdamWTest, Bf16WeightsFollowTheFloat32RunThroughMasterWeights) {
  at::Generator gen = make_gen(11);
  const at::Tensor start = (0.07 + 0.05 * at::rand({64}, gen)).to(at::kBFloat16);  // bf16 values
  const at::Tensor grad = randn({64}, gen).to(at::kBFloat16);                      // what a bf16 backward gives
  AdamParams h;
  h.learning_rate = 1e-5;
  h.eps = 1e-8;
  at::Tensor bf16 = start.clone(), f32 = start.to(at::kFloat);
  AdamState bf16_state, f32_state;
  for (int step = 0; step < 200; ++step) {
    bf16_state.step({{"w", bf16, grad}}, h);
    f32_state.step({{"w", f32, grad.to(at::kFloat)}}, h);
  }
  ASSERT_EQ(bf16.scalar_type(), at::kBFloat16);
  // The float32 run moved every weight by 200 lr against its gradient's sign.
  const at::Tensor expected_move = -200 * h.learning_rate * grad.to(at::kFloat).sign();
  EXPECT_TENSOR_CLOSE(f32 - start.to(at::kFloat), expected_move, 0, 1e-5);
  // The bf16 weights moved with it: exactly its rounding (the master is the float32 run, op for op).
  EXPECT_TENSOR_EQ(bf16, f32.to(at::kBFloat16));
  EXPECT_TENSOR_CLOSE(bf16.to(at::kFloat) - start.to(at::kFloat), expected_move, 0, 2.5e-4);  // half an ulp
  EXPECT_TRUE(at::all(bf16 != start).item<bool>());
}

TEST(AdamWTest, MastersOnlyForLowPrecisionTensorsAndRebuiltAfterDrop) {
  at::Generator gen = make_gen(12);
  at::Tensor f = randn({4}, gen), b = randn({3, 2}, gen).to(at::kBFloat16);
  const at::Tensor gf = randn({4}, gen), gb = randn({3, 2}, gen).to(at::kBFloat16);
  AdamParams h = test_params();
  AdamState state;
  state.step({{"f", f, gf}, {"b", b, gb}}, h);
  ASSERT_EQ(state.masters().size(), 1u);  // float32 weights are their own master: no copy
  const at::Tensor& master = state.masters().at("b");
  EXPECT_EQ(master.scalar_type(), at::kFloat);
  EXPECT_TENSOR_EQ(master.to(at::kBFloat16), b);

  // A restored state (moments and master) continues exactly like the original.
  at::Tensor f2 = f.clone(), b2 = b.clone();
  std::map<std::string, std::pair<at::Tensor, at::Tensor>> moments;
  for (const auto& [name, mv] : state.moments()) moments[name] = {mv.first.clone(), mv.second.clone()};
  AdamState restored;
  restored.restore(state.num_steps(), moments, {{"b", master.clone()}});
  state.step({{"f", f, gf}, {"b", b, gb}}, h);
  restored.step({{"f", f2, gf}, {"b", b2, gb}}, h);
  EXPECT_TENSOR_EQ(b2, b);
  EXPECT_TENSOR_EQ(restored.masters().at("b"), state.masters().at("b"));

  // Overwritten weights: after drop_masters the next step starts from them, not from the old master.
  b.fill_(0.5);
  state.drop_masters();
  EXPECT_TRUE(state.masters().empty());
  state.step({{"f", f, gf}, {"b", b, gb}}, h);
  EXPECT_TRUE(at::all(at::abs(b.to(at::kFloat) - 0.5) < 0.05).item<bool>());
  EXPECT_TENSOR_EQ(state.masters().at("b").to(at::kBFloat16), b);
}

}  // namespace
}  // namespace skyrl_tx::optim
