// Tests the sequence-level losses (GSPO's per-datum ratio and its clipping) and the validation of their inputs.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cmath>
#include <map>
#include <string>

#include "batching/train_batch.h"
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

TEST(SequenceLossTest, SequenceLogRatioIsTheMaskedMeanPerDatum) {
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

TEST(SequenceLossTest, SequenceLogRatioFollowsPackedDatumBoundaries) {
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

TEST(SequenceLossTest, GspoTokensShareTheSequenceRatioAndKeepTheirOwnGradient) {
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

TEST(SequenceLossTest, GspoClipsTheSequenceRatioForWholeDatums) {
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

batching::TrainRequest gspo_request(std::map<std::string, at::Tensor> inputs) {
  batching::TrainDatum d{at::tensor({1, 2, 3, 4}, at::kLong), std::move(inputs)};
  return {"m", {d}, "gspo", {}};
}

TEST(SequenceLossTest, GspoRatioMaskDefaultsToTrainedTokens) {
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

TEST(SequenceLossTest, NewLossesNameAMissingInput) {
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

}  // namespace
}  // namespace skyrl_tx::loss
