// Tests backend::Backend: adapter lifecycle, PEFT-named weight I/O, batched token_logprobs and error kinds.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "common/errors.h"
#include "testing/tensor_asserts.h"
#include "testing/tiny_model.h"

namespace skyrl_tx::backend {
namespace {

using skyrl_tx::testing::make_gen;
using skyrl_tx::testing::random_tokens;
using skyrl_tx::testing::randn;
using skyrl_tx::testing::ReferenceModel;
using Weights = std::map<std::string, at::Tensor>;

lora::LoraConfig lora_config(int64_t rank, double alpha, uint64_t seed) {
  lora::LoraConfig c;
  c.rank = rank;
  c.alpha = alpha;
  c.seed = seed;
  return c;
}

class BackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_config_ = skyrl_tx::testing::tiny_qwen3_config();
    weights_ = skyrl_tx::testing::random_weights(model_config_, 77);
    config_.max_lora_adapters = 3;
    config_.max_lora_rank = 4;
    config_.logprobs_chunk_tokens = 7;  // chunks straddle rows and adapter segments
    backend_ = std::make_unique<Backend>(model_config_, config_, weights_);
  }

  // Random factors with the shapes get_adapter_weights reports.
  Weights random_factors(const std::string& id) {
    Weights out;
    for (const auto& [name, t] : backend_->get_adapter_weights(id)) out[name] = randn(t.sizes(), gen_, 0.2);
    return out;
  }

  at::Tensor tokens(int64_t len) { return random_tokens(len, model_config_.vocab_size, gen_); }

  // log-probs of one sequence alone under `id`.
  at::Tensor alone(const at::Tensor& ids, const at::Tensor& targets, const std::string& id) {
    return backend_->token_logprobs({ids}, {targets}, {id})[0];
  }

  models::ModelConfig model_config_;
  models::WeightMap weights_;
  BackendConfig config_;
  std::unique_ptr<Backend> backend_;
  at::Generator gen_ = make_gen(3);
};

TEST_F(BackendTest, AdapterWeightsRoundTrip) {
  EXPECT_EQ(backend_->create_adapter("a", lora_config(4, 8.0, 1)), 1);
  Weights w = backend_->get_adapter_weights("a");
  ASSERT_EQ(w.size(), 2u * (2 * 7 + 1));
  ASSERT_EQ(backend_->adapter_module_names("a").size(), 15u);
  const at::Tensor& q_a = w.at("model.layers.0.self_attn.q_proj.lora_A.weight");
  EXPECT_EQ(q_a.sizes(), at::IntArrayRef({4, model_config_.hidden_size}));
  EXPECT_GT(q_a.abs().max().item<float>(), 0.0f);
  EXPECT_EQ(w.at("model.layers.1.mlp.down_proj.lora_B.weight").sizes(), at::IntArrayRef({model_config_.hidden_size, 4}));
  EXPECT_EQ(w.at("lm_head.lora_B.weight").sizes(), at::IntArrayRef({model_config_.vocab_size, 4}));
  for (const auto& [name, t] : w) {
    EXPECT_EQ(t.scalar_type(), at::kFloat) << name;
    if (name.find("lora_B") != std::string::npos) EXPECT_EQ(t.abs().max().item<float>(), 0.0f) << name;
  }

  Weights set = random_factors("a");
  backend_->set_adapter_weights("a", set);
  Weights got = backend_->get_adapter_weights("a");
  ASSERT_EQ(got.size(), set.size());
  for (const auto& [name, t] : set) EXPECT_TENSOR_EQ(got.at(name), t) << name;
  // The returned tensors are copies: editing them does not touch the adapter.
  got.begin()->second.fill_(123.0);
  EXPECT_TENSOR_EQ(backend_->get_adapter_weights("a").at(got.begin()->first), set.at(got.begin()->first));
}

TEST_F(BackendTest, FreshAdapterEqualsBaseAndBaseMatchesReference) {
  backend_->create_adapter("a", lora_config(4, 16.0, 9));
  at::Tensor ids = tokens(11), targets = tokens(11);
  at::Tensor base = alone(ids, targets, "");
  ASSERT_EQ(base.sizes(), at::IntArrayRef({11}));
  EXPECT_EQ(base.scalar_type(), at::kFloat);
  EXPECT_TENSOR_CLOSE(alone(ids, targets, "a"), base, 1e-6, 1e-6);
  ReferenceModel ref{model_config_, weights_};
  EXPECT_TENSOR_CLOSE(base, ref.logprobs(ids, targets), 1e-4, 1e-5);
}

TEST_F(BackendTest, MixedBatchEqualsEachRowAloneWithItsAdapter) {
  backend_->create_adapter("a", lora_config(4, 8.0, 1));
  lora::LoraConfig b_config = lora_config(2, 2.0, 2);
  b_config.train_mlp = false;
  backend_->create_adapter("b", b_config);
  backend_->set_adapter_weights("a", random_factors("a"));
  backend_->set_adapter_weights("b", random_factors("b"));

  const std::vector<std::string> ids = {"a", "", "b", "a", "", "b"};
  const std::vector<int64_t> lengths = {6, 4, 9, 3, 9, 1};
  std::vector<at::Tensor> inputs, targets;
  for (int64_t len : lengths) {
    inputs.push_back(tokens(len));
    targets.push_back(tokens(len));
  }
  std::vector<at::Tensor> batched = backend_->token_logprobs(inputs, targets, ids);
  ASSERT_EQ(batched.size(), ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    ASSERT_EQ(batched[i].sizes(), at::IntArrayRef({lengths[i]}));
    EXPECT_TENSOR_CLOSE(batched[i], alone(inputs[i], targets[i], ids[i]), 1e-5, 1e-5) << "request " << i;
    // Against the plain-ATen decoder with this adapter's factors.
    ReferenceModel ref{model_config_, weights_};
    if (!ids[i].empty()) {
      ref.lora = backend_->get_adapter_weights(ids[i]);
      ref.scaling = ids[i] == "a" ? 2.0 : 1.0;
    }
    EXPECT_TENSOR_CLOSE(batched[i], ref.logprobs(inputs[i], targets[i]), 1e-4, 1e-5) << "request " << i;
    if (!ids[i].empty() && lengths[i] > 1) {
      EXPECT_FALSE(at::allclose(batched[i], alone(inputs[i], targets[i], ""), 1e-3, 1e-3)) << "request " << i;
    }
  }
}

TEST_F(BackendTest, RecreatedSlotStartsClean) {
  backend_->create_adapter("a", lora_config(4, 8.0, 1));
  EXPECT_EQ(backend_->create_adapter("b", lora_config(4, 8.0, 1)), 2);
  Weights a_init = backend_->get_adapter_weights("a");
  Weights b_set = random_factors("b");
  backend_->set_adapter_weights("a", random_factors("a"));
  backend_->set_adapter_weights("b", b_set);

  backend_->remove_adapter("a");
  EXPECT_THROW(backend_->get_adapter_weights("a"), NotFound);
  EXPECT_EQ(backend_->create_adapter("c", lora_config(2, 4.0, 2)), 1);  // a's old slot
  Weights c = backend_->get_adapter_weights("c");
  ASSERT_EQ(c.size(), a_init.size());
  for (const auto& [name, t] : c) {
    if (name.find("lora_B") != std::string::npos) EXPECT_EQ(t.abs().max().item<float>(), 0.0f) << name;
    else EXPECT_EQ(t.size(0), 2) << name;
  }
  const std::string q_a = "model.layers.0.self_attn.q_proj.lora_A.weight";
  EXPECT_FALSE(at::allclose(c.at(q_a), a_init.at(q_a).narrow(0, 0, 2)));  // another seed, another A
  // The same seed in another slot gives the same A everywhere.
  EXPECT_EQ(backend_->create_adapter("d", lora_config(2, 4.0, 2)), 3);
  for (const auto& [name, t] : backend_->get_adapter_weights("d")) EXPECT_TENSOR_EQ(t, c.at(name)) << name;

  at::Tensor ids = tokens(8), targets = tokens(8);
  EXPECT_TENSOR_CLOSE(alone(ids, targets, "c"), alone(ids, targets, ""), 1e-6, 1e-6);
  for (const auto& [name, t] : backend_->get_adapter_weights("b")) EXPECT_TENSOR_EQ(t, b_set.at(name)) << name;
}

TEST_F(BackendTest, TargetGroupsSelectModules) {
  lora::LoraConfig no_unembed = lora_config(2, 2.0, 1);
  no_unembed.train_unembed = false;
  backend_->create_adapter("x", no_unembed);
  Weights x = backend_->get_adapter_weights("x");
  EXPECT_EQ(x.count("lm_head.lora_A.weight"), 0u);
  EXPECT_EQ(x.count("lm_head.lora_B.weight"), 0u);
  EXPECT_EQ(x.size(), 2u * 14);

  lora::LoraConfig mlp_only = lora_config(2, 2.0, 1);
  mlp_only.train_attn = mlp_only.train_unembed = false;
  backend_->create_adapter("y", mlp_only);
  Weights y = backend_->get_adapter_weights("y");
  EXPECT_EQ(y.size(), 2u * 6);
  EXPECT_EQ(y.count("model.layers.0.self_attn.q_proj.lora_A.weight"), 0u);
  EXPECT_EQ(y.count("model.layers.1.mlp.up_proj.lora_B.weight"), 1u);
  // Factors for a module the adapter does not target are rejected.
  Weights with_head = random_factors("x");
  with_head["lm_head.lora_A.weight"] = randn({2, model_config_.hidden_size}, gen_);
  EXPECT_THROW(backend_->set_adapter_weights("x", with_head), InvalidArgument);
}

TEST_F(BackendTest, SetAdapterWeightsRejectsBadInput) {
  backend_->create_adapter("a", lora_config(4, 8.0, 1));
  Weights extra = random_factors("a");
  extra["model.layers.0.self_attn.q_proj.lora_C.weight"] = randn({4, 4}, gen_);
  try {
    backend_->set_adapter_weights("a", extra);
    ADD_FAILURE() << "unexpected key accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("lora_C"), std::string::npos) << e.what();
  }
  Weights missing = random_factors("a");
  missing.erase("model.layers.1.mlp.gate_proj.lora_B.weight");
  EXPECT_THROW(backend_->set_adapter_weights("a", missing), InvalidArgument);
  Weights misshaped = random_factors("a");
  misshaped["lm_head.lora_A.weight"] = randn({3, model_config_.hidden_size}, gen_);
  EXPECT_THROW(backend_->set_adapter_weights("a", misshaped), InvalidArgument);
  EXPECT_THROW(backend_->set_adapter_weights("", random_factors("a")), InvalidArgument);
}

TEST_F(BackendTest, RejectedAdapterWeightsLeaveTheAdapterUntouched) {
  backend_->create_adapter("a", lora_config(4, 8.0, 1));
  const Weights before = backend_->get_adapter_weights("a");
  Weights bad = random_factors("a");
  bad["bogus"] = randn({2, 2}, gen_);  // rejected only after every module was looked at
  EXPECT_THROW(backend_->set_adapter_weights("a", bad), InvalidArgument);
  for (const auto& [name, tensor] : backend_->get_adapter_weights("a")) EXPECT_TENSOR_EQ(tensor, before.at(name));
}

TEST_F(BackendTest, ErrorKinds) {
  backend_->create_adapter("a", lora_config(4, 8.0, 1));
  at::Tensor ids = tokens(4);
  EXPECT_THROW(backend_->token_logprobs({ids}, {ids}, {"nope"}), NotFound);
  EXPECT_THROW(backend_->get_adapter_weights("nope"), NotFound);
  EXPECT_THROW(backend_->set_adapter_weights("nope", {}), NotFound);
  EXPECT_THROW(backend_->remove_adapter("nope"), NotFound);
  EXPECT_THROW(backend_->create_adapter("a", lora_config(4, 8.0, 1)), Conflict);
  EXPECT_THROW(backend_->create_adapter("big", lora_config(5, 8.0, 1)), InvalidArgument);
  try {
    at::Tensor bad = at::tensor(std::vector<int64_t>{1, model_config_.vocab_size}, at::kLong);
    backend_->token_logprobs({bad}, {ids.narrow(0, 0, 2)}, {""});
    ADD_FAILURE() << "out-of-vocab token accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(std::to_string(model_config_.vocab_size)), std::string::npos) << e.what();
  }
  EXPECT_THROW(backend_->token_logprobs({ids}, {ids.narrow(0, 0, 3)}, {"a"}), InvalidArgument);
  backend_->create_adapter("b", lora_config(1, 1.0, 1));
  backend_->create_adapter("c", lora_config(1, 1.0, 1));
  EXPECT_THROW(backend_->create_adapter("d", lora_config(1, 1.0, 1)), ResourceExhausted);
  backend_->remove_adapter("b");
  EXPECT_EQ(backend_->create_adapter("d", lora_config(1, 1.0, 1)), 2);
}

TEST(BackendConfig, ConstructorValidates) {
  models::ModelConfig mc = skyrl_tx::testing::tiny_llama_config();
  models::WeightMap w = skyrl_tx::testing::random_weights(mc, 8);
  auto build = [&](const BackendConfig& c) { Backend b(mc, c, w); };
  BackendConfig ok;
  EXPECT_NO_THROW(build(ok));
  BackendConfig chunk = ok;
  chunk.logprobs_chunk_tokens = 0;
  EXPECT_THROW(build(chunk), InvalidArgument);
  BackendConfig dtype = ok;
  dtype.dtype = "float16";
  EXPECT_THROW(build(dtype), InvalidArgument);
  BackendConfig rank = ok;
  rank.max_lora_rank = 0;
  EXPECT_THROW(build(rank), InvalidArgument);
  BackendConfig slots = ok;
  slots.max_lora_adapters = 0;
  EXPECT_THROW(build(slots), InvalidArgument);
  models::WeightMap broken = w;
  broken.erase("model.norm.weight");
  EXPECT_THROW((void)Backend(mc, ok, broken), InvalidArgument);
  models::ModelConfig no_heads = mc;  // must be a typed error, not a division by zero in RoPE setup
  no_heads.num_attention_heads = 0;
  no_heads.head_dim = 0;
  EXPECT_THROW((void)Backend(no_heads, ok, w), InvalidArgument);
}

}  // namespace
}  // namespace skyrl_tx::backend
