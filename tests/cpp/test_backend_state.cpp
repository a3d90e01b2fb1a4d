// Tests Backend's checkpoint half: optimizer state out/in, trainable state in, snapshots from saved weights,
// frozen full-model snapshots.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "common/errors.h"
#include "testing/tiny_model.h"

namespace skyrl_tx::backend {
namespace {

using Weights = std::map<std::string, at::Tensor>;

class BackendStateTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_config_ = skyrl_tx::testing::tiny_qwen3_config();
    config_.max_lora_adapters = 3;
    config_.max_lora_rank = 4;
    config_.max_full_models = 2;
    backend_ = std::make_unique<Backend>(model_config_, config_, skyrl_tx::testing::random_weights(model_config_, 5));
  }

  lora::LoraConfig lora(uint64_t seed) const {
    lora::LoraConfig c;
    c.rank = 4;
    c.alpha = 8.0;
    c.seed = seed;
    return c;
  }

  // One cross-entropy forward_backward + AdamW step on a fixed sequence.
  void train_step(const std::string& id) {
    batching::TrainDatum datum;
    datum.input_tokens = at::arange(3, 15, at::kLong);                 // [12]
    datum.loss_fn_inputs["target_tokens"] = at::arange(4, 16, at::kLong);  // [12]
    datum.loss_fn_inputs["weights"] = at::ones({12}, at::kFloat);
    backend_->forward_backward({batching::TrainRequest{id, {datum}}});
    optim::AdamParams params;
    params.learning_rate = 1e-2;
    backend_->optim_step(id, params);
  }

  std::vector<int64_t> greedy(const std::string& weights_id) {
    sampling::SampleRequest r;
    r.weights_id = weights_id;
    r.prompt = at::arange(5, 11, at::kLong);  // [6]
    r.params.max_tokens = 6;
    r.params.temperature = 0.0;
    r.params.seed = 1;
    r.params.stop_at_eos = false;
    return backend_->sample({r})[0].sequences[0].tokens;
  }

  static void expect_equal(const Weights& a, const Weights& b) {
    ASSERT_EQ(a.size(), b.size());
    for (const auto& [name, t] : a) EXPECT_TRUE(at::equal(t, b.at(name))) << name;
  }

  models::ModelConfig model_config_;
  BackendConfig config_;
  std::unique_ptr<Backend> backend_;
};

TEST_F(BackendStateTest, RestoredWeightsAndOptimizerContinueExactly) {
  backend_->create_adapter("a", lora(1));
  train_step("a");
  train_step("a");
  const OptimizerState saved = backend_->optimizer_state("a");
  EXPECT_EQ(saved.step, 2);
  EXPECT_EQ(saved.exp_avg.size(), backend_->trainable_state("a").size());

  backend_->create_adapter("b", lora(99));  // other random init: everything must come from the restore
  backend_->set_trainable_state("b", backend_->trainable_state("a"));
  backend_->set_optimizer_state("b", saved);
  train_step("a");
  train_step("b");
  expect_equal(backend_->trainable_state("a"), backend_->trainable_state("b"));
  EXPECT_EQ(backend_->optimizer_state("b").step, 3);
}

TEST_F(BackendStateTest, WithoutOptimizerStateTheNextStepDiffers) {
  backend_->create_adapter("a", lora(1));
  train_step("a");
  backend_->create_adapter("b", lora(1));
  backend_->set_trainable_state("b", backend_->trainable_state("a"));  // fresh AdamW moments
  train_step("a");
  train_step("b");
  const Weights a = backend_->trainable_state("a"), b = backend_->trainable_state("b");
  bool any_differs = false;
  for (const auto& [name, t] : a) any_differs |= !at::allclose(t, b.at(name), 1e-6, 1e-7);
  EXPECT_TRUE(any_differs);
}

TEST_F(BackendStateTest, BadOptimizerStateIsRejectedAndChangesNothing) {
  backend_->create_adapter("a", lora(1));
  train_step("a");
  const OptimizerState good = backend_->optimizer_state("a");
  OptimizerState wrong_shape = good;
  auto& first = wrong_shape.exp_avg.begin()->second;
  first = at::zeros({first.size(0) + 1, first.size(1)});
  EXPECT_THROW(backend_->set_optimizer_state("a", wrong_shape), InvalidArgument);
  OptimizerState unknown = good;
  unknown.exp_avg_sq["model.layers.0.nope.lora_A.weight"] = at::zeros({1});
  EXPECT_THROW(backend_->set_optimizer_state("a", unknown), InvalidArgument);
  OptimizerState missing = good;
  missing.exp_avg.erase(missing.exp_avg.begin());
  EXPECT_THROW(backend_->set_optimizer_state("a", missing), InvalidArgument);
  const OptimizerState after = backend_->optimizer_state("a");
  EXPECT_EQ(after.step, good.step);
  expect_equal(after.exp_avg, good.exp_avg);
  EXPECT_THROW(backend_->optimizer_state("ghost"), NotFound);
}

TEST_F(BackendStateTest, SnapshotFromSavedFactorsSamplesLikeTheAdapter) {
  backend_->create_adapter("a", lora(1));
  train_step("a");
  backend_->load_snapshot("from-disk", lora(0), backend_->get_adapter_weights("a"));
  EXPECT_TRUE(backend_->has_snapshot("from-disk"));
  EXPECT_EQ(greedy("from-disk"), greedy("a"));
  Weights partial = backend_->get_adapter_weights("a");
  partial.erase(partial.begin());
  EXPECT_THROW(backend_->load_snapshot("partial", lora(0), partial), InvalidArgument);
  EXPECT_THROW(backend_->load_snapshot("from-disk", lora(0), backend_->get_adapter_weights("a")), Conflict);
}

TEST_F(BackendStateTest, FullModelSnapshotIsFrozen) {
  backend_->create_full_model("full");
  train_step("full");
  const std::vector<int64_t> before = greedy("full");
  backend_->snapshot_adapter("full", "frozen");
  EXPECT_EQ(greedy("frozen"), before);
  for (int i = 0; i < 5; ++i) train_step("full");
  EXPECT_EQ(greedy("frozen"), before);  // later steps change the live model, not the snapshot
  backend_->remove_snapshot("frozen");
  EXPECT_FALSE(backend_->has_snapshot("frozen"));
  EXPECT_THROW(greedy("frozen"), NotFound);
}

TEST_F(BackendStateTest, FullModelTrainableStateRoundTrips) {
  backend_->create_full_model("a");
  train_step("a");
  backend_->create_full_model("b");
  backend_->set_trainable_state("b", backend_->trainable_state("a"));
  backend_->set_optimizer_state("b", backend_->optimizer_state("a"));
  train_step("a");
  train_step("b");
  expect_equal(backend_->trainable_state("a"), backend_->trainable_state("b"));
  Weights bad = backend_->trainable_state("a");
  bad.erase(bad.begin());
  EXPECT_THROW(backend_->set_trainable_state("b", bad), InvalidArgument);
}

// A bfloat16 full fine-tune keeps float32 master weights beside its AdamW moments: counted in optimizer_state_bytes,
// exported and restored with the optimizer state (each must round to the loaded weight), rebuilt from the weights
// after set_trainable_state. LoRA factors, float32 masters themselves, keep none.
TEST_F(BackendStateTest, Bf16FullModelKeepsMasterWeightsInItsOptimizerState) {
  config_.dtype = "bfloat16";
  backend_ = std::make_unique<Backend>(model_config_, config_, skyrl_tx::testing::random_weights(model_config_, 5));
  backend_->create_full_model("a");
  train_step("a");
  const OptimizerState saved = backend_->optimizer_state("a");
  const Weights weights = backend_->trainable_state("a");
  ASSERT_EQ(saved.master.size(), weights.size());
  int64_t params = 0;
  for (const auto& [name, master] : saved.master) {
    EXPECT_EQ(master.scalar_type(), at::kFloat) << name;
    EXPECT_TRUE(at::equal(master.to(at::kBFloat16).to(at::kFloat), weights.at(name))) << name;
    params += master.numel();
  }
  EXPECT_EQ(backend_->optimizer_state_bytes("a"), 3 * 4 * params);  // 2 moments + master (gradients freed)

  // Weights, then optimizer state with its masters: continues exactly like the original.
  backend_->create_full_model("b");
  backend_->set_trainable_state("b", weights);
  OptimizerState stale = saved;  // a master that does not round to the loaded weight is refused, changing nothing
  stale.master.begin()->second = stale.master.begin()->second + 1.0;
  EXPECT_THROW(backend_->set_optimizer_state("b", stale), InvalidArgument);
  EXPECT_TRUE(backend_->optimizer_state("b").master.empty());
  backend_->set_optimizer_state("b", saved);
  train_step("a");
  train_step("b");
  expect_equal(backend_->trainable_state("a"), backend_->trainable_state("b"));
  expect_equal(backend_->optimizer_state("a").master, backend_->optimizer_state("b").master);

  // Loading weights drops the masters (the next step rebuilds them from the loaded weights).
  backend_->set_trainable_state("b", weights);
  EXPECT_TRUE(backend_->optimizer_state("b").master.empty());
  EXPECT_EQ(backend_->optimizer_state_bytes("b"), 2 * 4 * params);

  backend_->create_adapter("lora", lora(1));
  train_step("lora");
  EXPECT_TRUE(backend_->optimizer_state("lora").master.empty());
  EXPECT_FALSE(backend_->optimizer_state("lora").exp_avg.empty());
}

}  // namespace
}  // namespace skyrl_tx::backend
