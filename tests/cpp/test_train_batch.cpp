// Tests batching::validate_requests, plan_micro_batches and pack_training_rows (training request → micro-batches).
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "batching/train_batch.h"
#include "common/errors.h"
#include "testing/tensor_asserts.h"
#include "testing/tiny_model.h"

namespace skyrl_tx::batching {
namespace {

using loss::LossKind;
using skyrl_tx::testing::make_gen;
using skyrl_tx::testing::randn;

constexpr int64_t kVocab = 50;

at::Tensor tokens(int64_t n, int64_t offset = 0) { return at::arange(n, at::kLong).add(offset).remainder(kVocab); }

TrainDatum supervised(int64_t n) {
  TrainDatum d;
  d.input_tokens = tokens(n);
  d.loss_fn_inputs["target_tokens"] = tokens(n, 1);
  d.loss_fn_inputs["weights"] = at::ones({n}, at::kFloat);
  return d;
}

TrainDatum policy(int64_t n, uint64_t seed) {
  at::Generator gen = make_gen(seed);
  TrainDatum d;
  d.input_tokens = tokens(n);
  d.loss_fn_inputs["target_tokens"] = tokens(n, 1);
  d.loss_fn_inputs["logprobs"] = -at::rand({n}, gen, at::kFloat);
  d.loss_fn_inputs["advantages"] = randn({n}, gen);
  return d;
}

TrainRequest request(std::string loss_fn, std::vector<TrainDatum> data) {
  TrainRequest r;
  r.model_id = "m";
  r.loss_fn = std::move(loss_fn);
  r.data = std::move(data);
  return r;
}

// Runs validate_requests and expects InvalidArgument whose message contains every `parts` entry.
void expect_invalid(const std::vector<TrainRequest>& reqs, const std::vector<std::string>& parts) {
  try {
    validate_requests(reqs);
    ADD_FAILURE() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    for (const auto& p : parts) EXPECT_NE(e.message().find(p), std::string::npos) << "'" << p << "' in: " << e.message();
  }
}

TEST(TrainBatchTest, ValidRequestsFlattenToRows) {
  auto rows = validate_requests({request("cross_entropy", {supervised(4), supervised(6)}),
                                 request("ppo", {policy(5, 1)})});
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows[0].request, 0u);
  EXPECT_EQ(rows[1].datum, 1u);
  EXPECT_EQ(rows[2].request, 1u);
  EXPECT_EQ(rows[2].kind, LossKind::kPpo);
  EXPECT_EQ(rows[1].length(), 6);
  EXPECT_EQ(rows[0].target_tokens.scalar_type(), at::kLong);
  EXPECT_TENSOR_EQ(rows[0].target_tokens, tokens(4, 1));
}

TEST(TrainBatchTest, MissingRequiredInputNamesTheKey) {
  TrainDatum no_targets = supervised(4);
  no_targets.loss_fn_inputs.erase("target_tokens");
  expect_invalid({request("cross_entropy", {no_targets})}, {"target_tokens", "datum 0"});
  TrainDatum no_weights = supervised(4);
  no_weights.loss_fn_inputs.erase("weights");
  expect_invalid({request("cross_entropy", {supervised(3), no_weights})}, {"weights", "datum 1"});
  TrainDatum no_adv = policy(4, 2);
  no_adv.loss_fn_inputs.erase("advantages");
  expect_invalid({request("importance_sampling", {no_adv})}, {"advantages"});
}

TEST(TrainBatchTest, UnknownInputKeyIsRejected) {
  TrainDatum d = supervised(4);
  d.loss_fn_inputs["advantages"] = at::zeros({4});
  expect_invalid({request("cross_entropy", {d})}, {"advantages"});
  TrainDatum e = policy(4, 3);
  e.loss_fn_inputs["mask"] = at::ones({4});
  expect_invalid({request("ppo", {e})}, {"mask"});
}

TEST(TrainBatchTest, WrongLengthIsRejected) {
  TrainDatum d = supervised(4);
  d.loss_fn_inputs["weights"] = at::ones({5});
  expect_invalid({request("cross_entropy", {d})}, {"weights"});
  TrainDatum t = supervised(4);
  t.loss_fn_inputs["target_tokens"] = tokens(3);
  expect_invalid({request("cross_entropy", {t})}, {"target_tokens"});
  TrainDatum p = policy(4, 4);
  p.loss_fn_inputs["logprobs"] = at::zeros({2, 2});
  expect_invalid({request("dro", {p})}, {"logprobs"});
}

TEST(TrainBatchTest, FloatTargetTokensAreRejected) {
  TrainDatum d = supervised(4);
  d.loss_fn_inputs["target_tokens"] = tokens(4, 1).to(at::kFloat);
  expect_invalid({request("cross_entropy", {d})}, {"target_tokens"});
}

TEST(TrainBatchTest, UnknownLossNameIsRejected) {
  expect_invalid({request("grpo", {supervised(4)})}, {"grpo"});
}

TEST(TrainBatchTest, BadLossConfigIsRejected) {
  TrainRequest r = request("ppo", {policy(4, 5)});
  r.loss_fn_config["beta"] = 0.1;
  expect_invalid({r}, {"beta"});
}

TEST(TrainBatchTest, DefaultsAndPerTokenClipOverrides) {
  TrainRequest rl = request("ppo", {policy(4, 6)});
  rl.loss_fn_config["clip_high_threshold"] = 1.5;
  TrainDatum custom = policy(4, 7);
  custom.loss_fn_inputs["clip_low_threshold"] = at::tensor({0.1f, 0.2f, 0.3f, 0.4f});
  custom.loss_fn_inputs["weights"] = at::tensor({0.0f, 1.0f, 2.0f, 3.0f});
  rl.data.push_back(custom);
  auto rows = validate_requests({rl, request("dro", {policy(3, 8)})});
  ASSERT_EQ(rows.size(), 3u);
  // RL weights default to 1; config clip thresholds fill every token unless given per token.
  EXPECT_TENSOR_EQ(rows[0].weights, at::ones({4}, at::kFloat));
  EXPECT_TENSOR_CLOSE(rows[0].clip_low, at::full({4}, 0.8, at::kFloat), 0, 1e-7);
  EXPECT_TENSOR_CLOSE(rows[0].clip_high, at::full({4}, 1.5, at::kFloat), 0, 1e-7);
  EXPECT_TENSOR_EQ(rows[0].sampling_logprobs, policy(4, 6).loss_fn_inputs.at("logprobs"));
  EXPECT_TENSOR_EQ(rows[0].advantages, policy(4, 6).loss_fn_inputs.at("advantages"));
  EXPECT_TENSOR_EQ(rows[1].clip_low, at::tensor({0.1f, 0.2f, 0.3f, 0.4f}));
  EXPECT_TENSOR_CLOSE(rows[1].clip_high, at::full({4}, 1.5, at::kFloat), 0, 1e-7);
  EXPECT_TENSOR_EQ(rows[1].weights, at::tensor({0.0f, 1.0f, 2.0f, 3.0f}));
  EXPECT_EQ(rows[2].kind, LossKind::kDro);
  EXPECT_DOUBLE_EQ(rows[2].beta, 0.01);
  EXPECT_TENSOR_EQ(rows[2].weights, at::ones({3}, at::kFloat));
}

std::vector<TrainRow> rows_of_lengths(const std::vector<int64_t>& lengths) {
  std::vector<TrainDatum> data;
  for (int64_t n : lengths) data.push_back(supervised(n));
  return validate_requests({request("cross_entropy", data)});
}

TEST(TrainBatchTest, PlanMicroBatchesRespectsBudgetAndCoversEveryRow) {
  const std::vector<int64_t> lengths = {3, 9, 1, 7, 7, 2, 5, 4, 8, 6, 20, 2};
  auto rows = rows_of_lengths(lengths);
  std::vector<size_t> ids(rows.size());
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = i;
  for (int64_t budget : {1, 8, 16, 20, 33, 1000}) {
    SCOPED_TRACE("budget " + std::to_string(budget));
    auto batches = plan_micro_batches(rows, ids, budget);
    std::vector<int> seen(rows.size(), 0);
    for (const auto& b : batches) {
      ASSERT_FALSE(b.empty());
      int64_t longest = 0;
      for (size_t id : b) {
        ++seen.at(id);
        longest = std::max(longest, rows[id].length());
      }
      if (b.size() > 1) {
        EXPECT_LE(static_cast<int64_t>(b.size()) * longest, budget);
      }
    }
    for (size_t i = 0; i < seen.size(); ++i) EXPECT_EQ(seen[i], 1) << "row " << i;
    if (budget == 1000) EXPECT_EQ(batches.size(), 1u);
    if (budget == 1) EXPECT_EQ(batches.size(), rows.size());
  }
  // A row limit too (the seed's train_micro_batch_size): never more rows, the token budget still holds.
  for (int64_t max_rows : {1, 3}) {
    auto limited = plan_micro_batches(rows, ids, 1000, max_rows);
    EXPECT_EQ(limited.size(), (rows.size() + max_rows - 1) / max_rows);
    for (const auto& b : limited) EXPECT_LE(static_cast<int64_t>(b.size()), max_rows);
  }
  EXPECT_EQ(plan_micro_batches(rows, ids, 16, 100), plan_micro_batches(rows, ids, 16));
  // A subset of ids: only those rows appear.
  auto batches = plan_micro_batches(rows, {1, 4, 10}, 16);
  std::vector<size_t> all;
  for (const auto& b : batches) all.insert(all.end(), b.begin(), b.end());
  std::sort(all.begin(), all.end());
  EXPECT_EQ(all, (std::vector<size_t>{1, 4, 10}));
}

TEST(TrainBatchTest, PackTrainingRowsPlacesInputsAtPackedRows) {
  TrainRequest ce = request("cross_entropy", {supervised(3)});
  ce.data[0].loss_fn_inputs["weights"] = at::tensor({0.5f, 1.0f, 2.0f});
  TrainRequest ppo = request("ppo", {policy(5, 9)});
  TrainRequest dro = request("dro", {policy(2, 10)});
  dro.loss_fn_config["beta"] = 0.25;
  auto rows = validate_requests({ce, ppo, dro});
  ASSERT_EQ(rows.size(), 3u);
  // Slots out of order so the packing reorders rows.
  const std::vector<int64_t> slots = {2, 0, 1};
  auto [batch, in] = pack_training_rows({&rows[0], &rows[1], &rows[2]}, slots, kVocab, at::kCPU);
  const int64_t B = batch.input_ids.size(0), T = batch.input_ids.size(1);
  ASSERT_EQ(B, 3);
  ASSERT_EQ(T, 5);
  ASSERT_EQ(in.kind.numel(), B * T);
  at::Tensor kind = in.kind.view({B, T}), valid = in.valid.view({B, T}), w = in.weights.view({B, T});
  at::Tensor q = in.sampling_logprobs.view({B, T}), adv = in.advantages.view({B, T});
  at::Tensor lo = in.clip_low.view({B, T}), hi = in.clip_high.view({B, T}), beta = in.beta.view({B, T});
  for (size_t i = 0; i < rows.size(); ++i) {
    SCOPED_TRACE("row " + std::to_string(i));
    const int64_t p = batch.packed_row[i], n = rows[i].length();
    EXPECT_TENSOR_EQ(batch.input_ids[p].narrow(0, 0, n), rows[i].input_tokens);
    EXPECT_TENSOR_EQ(batch.target_ids[p].narrow(0, 0, n), rows[i].target_tokens);
    EXPECT_TRUE(valid[p].narrow(0, 0, n).all().item<bool>());
    if (n < T) EXPECT_FALSE(valid[p].narrow(0, n, T - n).any().item<bool>());
    EXPECT_TRUE((kind[p].narrow(0, 0, n) == static_cast<int64_t>(rows[i].kind)).all().item<bool>());
    EXPECT_TENSOR_EQ(w[p].narrow(0, 0, n), rows[i].weights);
    EXPECT_TENSOR_EQ(q[p].narrow(0, 0, n), rows[i].sampling_logprobs);
    EXPECT_TENSOR_EQ(adv[p].narrow(0, 0, n), rows[i].advantages);
    EXPECT_TENSOR_EQ(lo[p].narrow(0, 0, n), rows[i].clip_low);
    EXPECT_TENSOR_EQ(hi[p].narrow(0, 0, n), rows[i].clip_high);
    EXPECT_TENSOR_CLOSE(beta[p].narrow(0, 0, n), at::full({n}, rows[i].beta, at::kFloat), 0, 1e-7);
  }
  // Sorted by slot: slot 0 (the ppo row) first.
  EXPECT_EQ(batch.packed_row[1], 0);
  EXPECT_EQ(batch.packed_row[2], 1);
  EXPECT_EQ(batch.packed_row[0], 2);
  // slice_inputs: one packed row's tokens.
  loss::LossInputs s = slice_inputs(in, T, T);
  EXPECT_TENSOR_EQ(s.weights, w[1]);
  EXPECT_TENSOR_EQ(s.kind, kind[1]);
}

}  // namespace
}  // namespace skyrl_tx::batching
