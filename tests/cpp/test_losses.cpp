// Tests loss::elementwise_loss against plain-ATen formulas (values and gradients) and loss name/config parsing.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "batching/train_batch.h"
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

// Message of the InvalidArgument `fn` throws ("" and a test failure when it throws nothing).
template <typename Fn>
std::string invalid_argument_message(Fn fn) {
  try {
    fn();
  } catch (const InvalidArgument& e) {
    return e.message();
  }
  ADD_FAILURE() << "expected InvalidArgument";
  return "";
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

// Two datums of T = 5 tokens packed as rows; the second is padded after 3 tokens.
struct GspoBatch {
  LossInputs in;
  at::Tensor lp;  // [10]
};

GspoBatch gspo_batch(uint64_t seed) {
  constexpr int64_t kRows = 2, kT = 5, kTokens = kRows * kT;
  at::Generator gen = make_gen(seed);
  LossInputs in;
  in.kind = at::full({kTokens}, static_cast<int64_t>(LossKind::kGspo), at::kLong);
  in.valid = at::tensor({1, 1, 1, 1, 1, 1, 1, 1, 0, 0}, at::kLong).to(at::kBool);
  in.weights = at::rand({kTokens}, gen, at::kFloat) + 0.5;
  in.sampling_logprobs = -at::rand({kTokens}, gen, at::kFloat) * 2.0;
  in.advantages = randn({kTokens}, gen);
  in.clip_low = at::full({kTokens}, 0.8f, at::kFloat);
  in.clip_high = at::full({kTokens}, 1.2f, at::kFloat);
  in.beta = at::zeros({kTokens}, at::kFloat);
  // Row 0: the prompt's first two tokens are out of the ratio. Row 1: a mask of 1 on padding must not count.
  in.ratio_mask = at::tensor({0.f, 0.f, 1.f, 1.f, 1.f, 1.f, 2.f, 1.f, 1.f, 1.f});
  in.has_sequence_losses = true;
  at::Tensor lp = (in.sampling_logprobs + randn({kTokens}, gen, 0.3)).detach();
  return {in, lp};
}

// The datum of each of gspo_batch's tokens: two padded rows of five.
at::Tensor two_rows_of_five() { return at::arange(2, at::kLong).repeat_interleave(5); }

TEST(LossTest, SequenceLogRatioIsTheMaskedMeanPerDatum) {
  GspoBatch b = gspo_batch(70);
  at::Tensor diff = b.lp - b.in.sampling_logprobs;
  const double s0 = diff.narrow(0, 2, 3).mean().item<double>();
  const double s1 = diff.narrow(0, 5, 3).mean().item<double>();  // tokens 8, 9 are padding
  at::Tensor expected = at::tensor({s0, s0, s0, s0, s0, s1, s1, s1, s1, s1}, at::kFloat);
  at::Tensor lp = b.lp.clone().requires_grad_(true);
  at::Tensor got = sequence_log_ratio(lp, b.in, two_rows_of_five(), 2);
  EXPECT_TENSOR_CLOSE(got, expected, 1e-6, 1e-6);
  EXPECT_FALSE(got.requires_grad()) << "the sequence ratio's value is a constant of the backward";
  // A datum with no masked token gets S = 0 (ratio 1), not NaN.
  b.in.ratio_mask = at::zeros({10}, at::kFloat);
  EXPECT_TENSOR_EQ(sequence_log_ratio(b.lp, b.in, two_rows_of_five(), 2), at::zeros({10}, at::kFloat));
}

TEST(LossTest, SequenceLogRatioFollowsPackedDatumBoundaries) {
  // Packed sequences: data of 3 and 7 tokens back to back, no padding; each datum's mean is over its own tokens.
  GspoBatch b = gspo_batch(72);
  b.in.valid = at::ones({10}, at::kBool);
  at::Tensor owner = at::tensor({0, 0, 0, 1, 1, 1, 1, 1, 1, 1}, at::kLong);
  at::Tensor diff = b.lp - b.in.sampling_logprobs;
  at::Tensor m = (b.in.ratio_mask != 0).to(at::kFloat);
  auto masked_mean = [&](int64_t begin, int64_t length) {
    return (diff.narrow(0, begin, length) * m.narrow(0, begin, length)).sum().item<double>() /
           m.narrow(0, begin, length).sum().item<double>();
  };
  const double s0 = masked_mean(0, 3), s1 = masked_mean(3, 7);
  at::Tensor expected = at::cat({at::full({3}, s0, at::kFloat), at::full({7}, s1, at::kFloat)});
  EXPECT_TENSOR_CLOSE(sequence_log_ratio(b.lp, b.in, owner, 2), expected, 1e-6, 1e-6);
}

TEST(LossTest, GspoTokensShareTheSequenceRatioAndKeepTheirOwnGradient) {
  GspoBatch b = gspo_batch(71);
  b.in.seq_log_ratio = sequence_log_ratio(b.lp, b.in, two_rows_of_five(), 2);
  b.in.clip_low.fill_(0.0), b.in.clip_high.fill_(100.0);  // nothing clipped: the plain GSPO-token gradient
  at::Tensor lp = b.lp.clone().requires_grad_(true);
  at::Tensor loss = elementwise_loss(lp, b.in);
  at::Tensor s = at::exp(b.in.seq_log_ratio);
  at::Tensor valid = b.in.valid.to(at::kFloat);
  EXPECT_TENSOR_CLOSE(loss.detach(), -s * b.in.advantages * b.in.weights * valid, 1e-5, 1e-6);
  loss.sum().backward();
  EXPECT_TENSOR_CLOSE(lp.grad(), -s * b.in.advantages * b.in.weights * valid, 1e-5, 1e-6);
}

TEST(LossTest, GspoClipsTheSequenceRatioForWholeDatums) {
  GspoBatch b = gspo_batch(72);
  // Datum 0's ratio exp(0.5) > 1.2, datum 1's exp(-0.5) < 0.8; advantages of both signs in each.
  b.in.seq_log_ratio = at::tensor({0.5f, 0.5f, 0.5f, 0.5f, 0.5f, -0.5f, -0.5f, -0.5f, -0.5f, -0.5f});
  b.in.advantages = at::tensor({1.f, -1.f, 1.f, -1.f, 1.f, 1.f, -1.f, 1.f, -1.f, 1.f});
  b.in.weights = at::ones({10}, at::kFloat);
  at::Tensor lp = b.lp.clone().requires_grad_(true);
  at::Tensor loss = elementwise_loss(lp, b.in);
  loss.sum().backward();
  const double hi = std::exp(0.5), lo = std::exp(-0.5);
  // -min(s·A, clip(s)·A): datum 0 (s > 1.2) A>0 → -1.2 (clipped, no grad), A<0 → s (grad); datum 1 (s < 0.8)
  // A>0 → -s (grad), A<0 → 0.8 (clipped, no grad). Padding: 0.
  at::Tensor expected = at::tensor({-1.2, hi, -1.2, hi, -1.2, -lo, 0.8, -lo, 0.0, 0.0}, at::kFloat);
  EXPECT_TENSOR_CLOSE(loss.detach(), expected, 1e-5, 1e-6);
  at::Tensor grad = at::tensor({0.0, hi, 0.0, hi, 0.0, -lo, 0.0, -lo, 0.0, 0.0}, at::kFloat);
  EXPECT_TENSOR_CLOSE(lp.grad(), grad, 1e-5, 1e-6);
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

batching::TrainRequest gspo_request(std::map<std::string, at::Tensor> inputs) {
  batching::TrainDatum d{at::tensor({1, 2, 3, 4}, at::kLong), std::move(inputs)};
  return {"m", {d}, "gspo", {}};
}

TEST(LossTest, GspoRatioMaskDefaultsToTrainedTokens) {
  std::map<std::string, at::Tensor> inputs = {{"target_tokens", at::tensor({2, 3, 4, 5}, at::kLong)},
                                              {"logprobs", at::full({4}, -1.0f, at::kFloat)},
                                              {"advantages", at::tensor({0.f, 0.5f, 0.5f, 0.5f})},
                                              {"weights", at::tensor({1.f, 1.f, 0.f, 1.f})}};
  auto rows = batching::validate_requests({gspo_request(inputs)});
  EXPECT_TENSOR_EQ(rows.at(0).ratio_mask, at::tensor({0.f, 1.f, 0.f, 1.f}));
  inputs["sequence_ratio_mask"] = at::tensor({1.f, 1.f, 1.f, 0.f});
  rows = batching::validate_requests({gspo_request(inputs)});
  EXPECT_TENSOR_EQ(rows.at(0).ratio_mask, at::tensor({1.f, 1.f, 1.f, 0.f}));
  // Other losses carry no mask.
  inputs.erase("sequence_ratio_mask");
  batching::TrainRequest other = gspo_request(inputs);
  other.loss_fn = "stable_reinforce";
  EXPECT_FALSE(batching::validate_requests({other}).at(0).ratio_mask.defined());
}

TEST(LossTest, NewLossesNameAMissingInput) {
  for (const char* name : {"gspo", "stable_reinforce"}) {
    SCOPED_TRACE(name);
    batching::TrainRequest req = gspo_request({{"target_tokens", at::tensor({2, 3, 4, 5}, at::kLong)},
                                               {"logprobs", at::full({4}, -1.0f, at::kFloat)}});
    req.loss_fn = name;
    EXPECT_NE(invalid_argument_message([&] { batching::validate_requests({req}); }).find("'advantages'"),
              std::string::npos);
  }
  batching::TrainRequest req = gspo_request({{"target_tokens", at::tensor({2, 3, 4, 5}, at::kLong)},
                                             {"logprobs", at::full({4}, -1.0f, at::kFloat)},
                                             {"advantages", at::ones({4}, at::kFloat)},
                                             {"sequence_ratio_mask", at::ones({3}, at::kFloat)}});
  EXPECT_NE(invalid_argument_message([&] { batching::validate_requests({req}); }).find("sequence_ratio_mask"),
            std::string::npos);
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
