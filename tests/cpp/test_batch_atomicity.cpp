// Tests that a training batch is all-or-nothing: a micro-batch failing at run time (injected by the test build's
// fault hook) leaves every model's accumulated gradients exactly as before, and training then goes on as if the
// failed batch had never been seen.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/fault_injection.h"
#include "common/errors.h"
#include "testing/tiny_model.h"

namespace skyrl_tx::backend {
namespace {

using Weights = std::map<std::string, at::Tensor>;
using skyrl_tx::testing::make_gen;
using skyrl_tx::testing::random_tokens;

const std::vector<std::string> kModels = {"a", "b", "full"};

class BatchAtomicityTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_config_ = skyrl_tx::testing::tiny_qwen3_config();
    config_.max_lora_adapters = 3;
    config_.max_lora_rank = 4;
    config_.max_full_models = 1;
    // 12-token rows: one row per micro-batch, so a batch with one row per model runs 3 micro-batches
    // (two on the shared base for the adapters, one on the full model).
    config_.train_micro_batch_tokens = 16;
    config_.logprobs_chunk_tokens = 5;
    const models::WeightMap weights = skyrl_tx::testing::random_weights(model_config_, 11);
    live_ = make_backend(weights);
    ref_ = make_backend(weights);
  }
  void TearDown() override { fault_injection::fail_micro_batch(-1); }

  std::unique_ptr<Backend> make_backend(const models::WeightMap& weights) const {
    auto backend = std::make_unique<Backend>(model_config_, config_, weights);
    backend->create_adapter("a", lora(1));
    backend->create_adapter("b", lora(2));
    backend->create_full_model("full");
    return backend;
  }

  static lora::LoraConfig lora(uint64_t seed) {
    lora::LoraConfig c;
    c.rank = 4;
    c.alpha = 8.0;
    c.seed = seed;
    return c;
  }

  // One 12-token cross-entropy datum per model, from `seed`.
  std::vector<batching::TrainRequest> batch(uint64_t seed) const {
    at::Generator gen = make_gen(seed);
    std::vector<batching::TrainRequest> out;
    for (const std::string& id : kModels) {
      batching::TrainDatum datum;
      datum.input_tokens = random_tokens(12, model_config_.vocab_size, gen);                     // [12]
      datum.loss_fn_inputs["target_tokens"] = random_tokens(12, model_config_.vocab_size, gen);  // [12]
      datum.loss_fn_inputs["weights"] = at::ones({12}, at::kFloat);
      out.push_back(batching::TrainRequest{id, {datum}});
    }
    return out;
  }

  static std::map<std::string, Weights> grads(const Backend& backend) {
    std::map<std::string, Weights> out;
    for (const std::string& id : kModels) out[id] = backend.trainable_grads(id);
    return out;
  }

  static void step(Backend& backend) {
    optim::AdamParams params;
    params.learning_rate = 1e-2;
    for (const std::string& id : kModels) backend.optim_step(id, params);
  }

  static void expect_equal(const std::map<std::string, Weights>& actual,
                           const std::map<std::string, Weights>& expected, const std::string& what) {
    for (const auto& [id, tensors] : expected) {
      ASSERT_EQ(actual.at(id).size(), tensors.size());
      for (const auto& [name, t] : tensors) {
        EXPECT_TRUE(at::equal(actual.at(id).at(name), t)) << what << ": " << id << " " << name;
      }
    }
  }

  static double max_abs(const std::map<std::string, Weights>& all) {
    double m = 0;
    for (const auto& [id, tensors] : all) {
      for (const auto& [name, t] : tensors) m = std::max(m, t.abs().max().item<double>());
    }
    return m;
  }

  models::ModelConfig model_config_;
  BackendConfig config_;
  std::unique_ptr<Backend> live_, ref_;
};

TEST_F(BatchAtomicityTest, FailedMicroBatchLeavesPendingGradientsExactly) {
  for (Backend* backend : {live_.get(), ref_.get()}) {
    backend->forward_backward(batch(1));
    step(*backend);                       // LoRA B is no longer zero: every factor gets a gradient
    backend->forward_backward(batch(2));  // gradients pending
  }
  const std::map<std::string, Weights> before = grads(*live_);
  ASSERT_GT(max_abs(before), 1e-3);
  for (int64_t k = 0; k < 3; ++k) {
    fault_injection::fail_micro_batch(k);
    EXPECT_THROW(live_->forward_backward(batch(3)), ResourceExhausted) << "micro-batch " << k;
    expect_equal(grads(*live_), before, "after a failure in micro-batch " + std::to_string(k));
  }
  // The hook is one-shot, and training goes on as if the failed batches had never been seen.
  for (Backend* backend : {live_.get(), ref_.get()}) {
    backend->forward_backward(batch(4));
    step(*backend);
  }
  std::map<std::string, Weights> live_state, ref_state;
  for (const std::string& id : kModels) {
    live_state[id] = live_->trainable_state(id);
    ref_state[id] = ref_->trainable_state(id);
  }
  expect_equal(live_state, ref_state, "weights after the next step");
}

TEST_F(BatchAtomicityTest, FailureWithNothingPendingLeavesNoGradients) {
  live_->forward_backward(batch(1));
  step(*live_);  // frees the gradients
  fault_injection::fail_micro_batch(1);
  EXPECT_THROW(live_->forward_backward(batch(3)), ResourceExhausted);
  EXPECT_EQ(max_abs(grads(*live_)), 0.0);
  ref_->forward_backward(batch(1));
  step(*ref_);
  for (Backend* backend : {live_.get(), ref_.get()}) {
    backend->forward_backward(batch(4));
  }
  expect_equal(grads(*live_), grads(*ref_), "gradients of the next batch");
}

TEST_F(BatchAtomicityTest, FailedForwardLeavesNoStateAndTheBatchHasThreeMicroBatches) {
  live_->forward_backward(batch(2));
  const std::map<std::string, Weights> before = grads(*live_);
  const std::vector<batching::TrainResult> expected = live_->forward(batch(3));
  fault_injection::fail_micro_batch(2);  // the last of the three
  EXPECT_THROW(live_->forward(batch(3)), ResourceExhausted);
  expect_equal(grads(*live_), before, "after a failed forward");
  fault_injection::fail_micro_batch(3);  // there is no fourth: nothing fails
  const std::vector<batching::TrainResult> again = live_->forward(batch(3));
  fault_injection::fail_micro_batch(-1);
  ASSERT_EQ(again.size(), expected.size());
  for (size_t r = 0; r < expected.size(); ++r) {
    EXPECT_TRUE(at::equal(again[r].loss_fn_outputs[0].logprobs, expected[r].loss_fn_outputs[0].logprobs));
  }
  expect_equal(grads(*live_), before, "after a forward");
}

}  // namespace
}  // namespace skyrl_tx::backend
