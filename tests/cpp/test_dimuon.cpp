// Tests optim::DimuonState and newton_schulz: orthogonal directions of norm ≈ √r for A and B, EMA momentum,
// clipping, zero momentum, validation.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cmath>
#include <vector>

#include "common/errors.h"
#include "optim/dimuon.h"
#include "testing/tiny_model.h"

namespace skyrl_tx::optim {
namespace {

using skyrl_tx::testing::make_gen;
using skyrl_tx::testing::randn;

constexpr int64_t kRank = 4;

double frobenius(const at::Tensor& t) { return t.to(at::kDouble).pow(2).sum().sqrt().item<double>(); }

TEST(DimuonTest, NewtonSchulzLeavesSingularValuesNearOne) {
  at::Generator gen = make_gen(1);
  const at::Tensor x = randn({3, kRank, 32}, gen);  // [n, r, k]
  const at::Tensor o = newton_schulz(x);
  ASSERT_EQ(o.sizes(), x.sizes());
  for (int64_t i = 0; i < 3; ++i) {
    const at::Tensor s = at::linalg_svdvals(o[i]);
    EXPECT_GT(s.min().item<double>(), 0.6);
    EXPECT_LT(s.max().item<double>(), 1.25);
  }
  EXPECT_TRUE(at::equal(newton_schulz(at::zeros({1, 2, 5})), at::zeros({1, 2, 5})));  // zeros stay zeros, no NaN
  EXPECT_THROW(newton_schulz(at::zeros({1, 5, 2})), InvalidArgument);                  // tall: orient it first
}

TEST(DimuonTest, StepMovesEveryFactorByLrTimesRootRank) {
  at::Generator gen = make_gen(2);
  at::Tensor a = randn({kRank, 16}, gen), b = randn({24, kRank}, gen);  // A [r, in], B [out, r]
  const at::Tensor a0 = a.clone(), b0 = b.clone();
  const at::Tensor ga = randn({kRank, 16}, gen), gb = randn({24, kRank}, gen);
  DimuonState state;
  DimuonParams p;
  p.learning_rate = 0.01;
  p.beta1 = 0.8;
  const auto metrics = state.step({{"a", a, ga}, {"b", b, gb}}, p);
  EXPECT_EQ(metrics.at("step"), 1.0);
  EXPECT_NEAR(metrics.at("grad_norm"), std::sqrt(std::pow(frobenius(ga), 2) + std::pow(frobenius(gb), 2)), 1e-4);
  // Same learning rate for A and B: each direction has r singular values ≈ 1, so a norm ≈ √r.
  for (const double moved : {frobenius(a - a0) / p.learning_rate, frobenius(b - b0) / p.learning_rate}) {
    EXPECT_GT(moved, 0.6 * std::sqrt(kRank));
    EXPECT_LT(moved, 1.25 * std::sqrt(kRank));
  }
  EXPECT_TRUE(at::allclose(state.momentum().at("a"), (1.0 - p.beta1) * ga, 0, 1e-6));  // m = (1 − β1)·g
  // A step without a gradient decays the momentum by β1 (and still moves along it).
  const at::Tensor before = b.clone();
  state.step({{"a", a, ga}, {"b", b, at::Tensor()}}, p);
  EXPECT_TRUE(at::allclose(state.momentum().at("b"), p.beta1 * (1.0 - p.beta1) * gb, 0, 1e-6));
  EXPECT_FALSE(at::equal(b, before));
}

TEST(DimuonTest, ClippingScalesTheMomentumNotTheDirection) {
  at::Generator gen = make_gen(3);
  at::Tensor a = randn({kRank, 16}, gen);
  const at::Tensor g = randn({kRank, 16}, gen) * 10.0;
  DimuonState clipped;
  DimuonParams p;
  p.grad_clip_norm = 0.5;
  clipped.step({{"a", a, g}}, p);
  const double scale = p.grad_clip_norm / (frobenius(g) + 1e-6);
  EXPECT_TRUE(at::allclose(clipped.momentum().at("a"), (1.0 - p.beta1) * scale * g, 1e-5, 1e-7));
  p.grad_clip_norm = -1.0;  // nonpositive: no clipping
  DimuonState unclipped;
  unclipped.step({{"a", a.clone(), g}}, p);
  EXPECT_TRUE(at::allclose(unclipped.momentum().at("a"), (1.0 - p.beta1) * g, 1e-5, 1e-7));
}

TEST(DimuonTest, RefusesBadParamsAndNonMatrices) {
  DimuonState state;
  at::Tensor a = at::zeros({kRank, 8});
  DimuonParams p;
  p.beta1 = 1.0;
  EXPECT_THROW(state.step({{"a", a, a}}, p), InvalidArgument);
  p = DimuonParams();
  p.learning_rate = NAN;
  EXPECT_THROW(state.step({{"a", a, a}}, p), InvalidArgument);
  p = DimuonParams();
  p.grad_clip_norm = INFINITY;
  EXPECT_THROW(state.step({{"a", a, a}}, p), InvalidArgument);
  at::Tensor bias = at::zeros({8});
  EXPECT_THROW(state.step({{"bias", bias, bias}}, DimuonParams()), InvalidArgument);
  EXPECT_EQ(state.num_steps(), 0);  // refused steps count nothing
}

}  // namespace
}  // namespace skyrl_tx::optim
