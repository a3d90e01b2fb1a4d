// Tests models::CausalLM on tiny random Qwen3 / Llama checkpoints: reference decoder, padding, adapters, tying.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

#include "batching/packing.h"
#include "common/errors.h"
#include "models/causal_lm.h"
#include "testing/tensor_asserts.h"
#include "testing/tiny_model.h"

namespace skyrl_tx::models {
namespace {

using skyrl_tx::testing::make_gen;
using skyrl_tx::testing::random_tokens;
using skyrl_tx::testing::randn;
using skyrl_tx::testing::ReferenceModel;

ModelOptions tiny_options() {
  ModelOptions o;
  o.num_slots = 3;
  o.max_rank = 4;
  return o;
}

// One sequence alone: no padding, no mask. ids: [T] → [T, hidden].
at::Tensor hidden_alone(const CausalLM& model, const at::Tensor& ids, int64_t slot) {
  const int64_t t = ids.size(0);
  return model.hidden_states(ids.unsqueeze(0), at::arange(t, at::kLong).unsqueeze(0), AttentionMask{},
                             lora::AdapterSegments::uniform(slot, t));
}

// A batch through pack_sequences (padded rows, or packed back to back); returns each request's [len, hidden] rows
// in request order.
std::vector<at::Tensor> hidden_batched(const CausalLM& model, const std::vector<at::Tensor>& seqs,
                                       const std::vector<int64_t>& slots,
                                       batching::RowLayout layout = batching::RowLayout::kPadded) {
  batching::PackedBatch b = batching::pack_sequences(seqs, seqs, slots, model.config().vocab_size, at::kCPU, layout);
  EXPECT_EQ(b.packed(), layout == batching::RowLayout::kPacked);
  at::Tensor h = model.hidden_states(b.input_ids, b.positions, b.mask, b.segments);  // [B * T, hidden]
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < seqs.size(); ++i) out.push_back(h.narrow(0, b.token_offset[i], b.lengths[i]));
  return out;
}

class CausalLMTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    config_ = GetParam() == "qwen3" ? skyrl_tx::testing::tiny_qwen3_config() : skyrl_tx::testing::tiny_llama_config();
    weights_ = skyrl_tx::testing::random_weights(config_, 2024);
    model_ = std::make_unique<CausalLM>(config_, weights_, tiny_options());
    gen_ = make_gen(5);
    for (int64_t len : {5, 9, 3, 9}) seqs_.push_back(random_tokens(len, config_.vocab_size, gen_));
  }

  ModelConfig config_;
  WeightMap weights_;
  std::unique_ptr<CausalLM> model_;
  at::Generator gen_;
  std::vector<at::Tensor> seqs_;
};

TEST_P(CausalLMTest, MatchesReferenceDecoder) {
  ReferenceModel ref{config_, weights_};
  for (const at::Tensor& ids : seqs_) {
    at::Tensor h = hidden_alone(*model_, ids, 0);
    ASSERT_EQ(h.sizes(), at::IntArrayRef({ids.size(0), config_.hidden_size}));
    EXPECT_TENSOR_CLOSE(h, ref.hidden(ids), 1e-4, 1e-5);
  }
}

TEST_P(CausalLMTest, PaddedBatchRowsEqualRowsAlone) {
  std::vector<at::Tensor> batched = hidden_batched(*model_, seqs_, {0, 0, 0, 0});
  for (size_t i = 0; i < seqs_.size(); ++i) {
    EXPECT_TENSOR_CLOSE(batched[i], hidden_alone(*model_, seqs_[i], 0), 1e-5, 1e-5) << "request " << i;
  }
  // A row's result does not depend on what it is batched with.
  std::vector<at::Tensor> pair = hidden_batched(*model_, {seqs_[2], seqs_[3]}, {0, 0});
  EXPECT_TENSOR_CLOSE(pair[0], batched[2], 1e-5, 1e-5);
}

TEST_P(CausalLMTest, PackedRowEqualsRowsAlone) {
  // Sequences back to back in one row attend only within themselves, under their own adapters.
  for (const auto& m : model_->lora_modules()) {
    m.module->enable_slot(1, 2, 0.5, make_gen(19));
    m.module->set_factors(1, randn({2, m.module->in_features()}, gen_, 0.2),
                          randn({m.module->out_features(), 2}, gen_, 0.2));
  }
  const std::vector<int64_t> slots = {1, 0, 1, 0};
  std::vector<at::Tensor> packed = hidden_batched(*model_, seqs_, slots, batching::RowLayout::kPacked);
  for (size_t i = 0; i < seqs_.size(); ++i) {
    EXPECT_TENSOR_CLOSE(packed[i], hidden_alone(*model_, seqs_[i], slots[i]), 1e-5, 1e-5) << "request " << i;
  }
}

TEST_P(CausalLMTest, FreshAdapterEqualsBaseAndTrainedAdapterMatchesReference) {
  for (const auto& m : model_->lora_modules()) m.module->enable_slot(1, 4, 2.0, make_gen(17));
  std::vector<int64_t> slots = {1, 0, 1, 0};
  std::vector<at::Tensor> fresh = hidden_batched(*model_, seqs_, slots);
  for (size_t i = 0; i < seqs_.size(); ++i) {
    EXPECT_TENSOR_CLOSE(fresh[i], hidden_alone(*model_, seqs_[i], 0), 1e-5, 1e-5) << "request " << i;
  }

  // Nonzero factors on slot 1: its rows follow the reference with LoRA, base rows stay base.
  ReferenceModel ref{config_, weights_};
  ref.scaling = 0.5;
  for (const auto& m : model_->lora_modules()) {
    m.module->enable_slot(1, 2, ref.scaling, make_gen(17));
    at::Tensor a = randn({2, m.module->in_features()}, gen_, 0.2), b = randn({m.module->out_features(), 2}, gen_, 0.2);
    m.module->set_factors(1, a, b);
    ref.lora[m.name + ".lora_A.weight"] = a;
    ref.lora[m.name + ".lora_B.weight"] = b;
  }
  std::vector<at::Tensor> trained = hidden_batched(*model_, seqs_, slots);
  for (size_t i = 0; i < seqs_.size(); ++i) {
    at::Tensor alone = hidden_alone(*model_, seqs_[i], slots[i]);
    EXPECT_TENSOR_CLOSE(trained[i], alone, 1e-5, 1e-5) << "request " << i;
    if (slots[i] == 1) {
      EXPECT_TENSOR_CLOSE(alone, ref.hidden(seqs_[i]), 1e-4, 1e-5) << "request " << i;
      EXPECT_FALSE(at::allclose(alone, fresh[i], 1e-3, 1e-3)) << "adapter had no effect on request " << i;
    } else {
      EXPECT_TENSOR_CLOSE(trained[i], fresh[i], 1e-5, 1e-5) << "base request " << i << " changed";
    }
  }
}

TEST_P(CausalLMTest, ListsEveryLoraModuleInOrder) {
  const auto& modules = model_->lora_modules();
  ASSERT_EQ(modules.size(), static_cast<size_t>(config_.num_hidden_layers * 7 + 1));
  const std::vector<std::string> per_layer = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                              "self_attn.o_proj", "mlp.gate_proj",    "mlp.up_proj",
                                              "mlp.down_proj"};
  for (int64_t l = 0; l < config_.num_hidden_layers; ++l) {
    for (size_t j = 0; j < per_layer.size(); ++j) {
      const auto& m = modules[l * 7 + j];
      EXPECT_EQ(m.name, "model.layers." + std::to_string(l) + "." + per_layer[j]);
      EXPECT_EQ(m.group, j < 4 ? LoraGroup::kAttention : LoraGroup::kMlp);
      ASSERT_NE(m.module, nullptr);
    }
  }
  EXPECT_EQ(modules.back().name, "lm_head");
  EXPECT_EQ(modules.back().group, LoraGroup::kUnembed);
  EXPECT_EQ(modules.back().module, &model_->lm_head());
  EXPECT_EQ(model_->lm_head().out_features(), config_.vocab_size);
}

INSTANTIATE_TEST_SUITE_P(Archs, CausalLMTest, ::testing::Values("qwen3", "llama"),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

TEST(CausalLM, TiedModelUsesTheEmbeddingAsLmHead) {
  ModelConfig c = skyrl_tx::testing::tiny_llama_config();
  WeightMap w = skyrl_tx::testing::random_weights(c, 1);
  ASSERT_EQ(w.count("lm_head.weight"), 0u);
  CausalLM model(c, w, tiny_options());
  EXPECT_TENSOR_EQ(model.lm_head().weight(), w.at("model.embed_tokens.weight"));

  // Some tied checkpoints repeat lm_head.weight: accepted, and the embedding still wins.
  at::Generator gen = make_gen(2);
  w["lm_head.weight"] = randn({c.vocab_size, c.hidden_size}, gen);
  CausalLM repeated(c, w, tiny_options());
  EXPECT_TENSOR_EQ(repeated.lm_head().weight(), w.at("model.embed_tokens.weight"));
}

TEST(CausalLM, UntiedModelUsesLmHeadWeight) {
  ModelConfig c = skyrl_tx::testing::tiny_qwen3_config();
  WeightMap w = skyrl_tx::testing::random_weights(c, 3);
  CausalLM model(c, w, tiny_options());
  EXPECT_TENSOR_EQ(model.lm_head().weight(), w.at("lm_head.weight"));
  EXPECT_FALSE(at::allclose(model.lm_head().weight(), w.at("model.embed_tokens.weight")));

  WeightMap missing = w;
  missing.erase("lm_head.weight");
  EXPECT_THROW((void)CausalLM(c, missing, tiny_options()), InvalidArgument);
}

TEST(CausalLM, BadCheckpointListsMissingAndUnexpectedKeys) {
  ModelConfig c = skyrl_tx::testing::tiny_qwen3_config();
  WeightMap w = skyrl_tx::testing::random_weights(c, 4);
  w.erase("model.layers.1.self_attn.q_norm.weight");
  w.erase("model.norm.weight");
  at::Generator gen = make_gen(5);
  w["model.layers.2.mlp.up_proj.weight"] = randn({4}, gen);
  try {
    CausalLM model(c, w, tiny_options());
    ADD_FAILURE() << "a broken checkpoint was accepted";
  } catch (const InvalidArgument& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("model.layers.1.self_attn.q_norm.weight"), std::string::npos) << msg;
    EXPECT_NE(msg.find("model.norm.weight"), std::string::npos) << msg;
    EXPECT_NE(msg.find("model.layers.2.mlp.up_proj.weight"), std::string::npos) << msg;
  }
  // A Llama config (no qk_norm) given Qwen3 weights: the q/k norms are unexpected.
  ModelConfig llama = c;
  llama.architecture = "LlamaForCausalLM";
  llama.qk_norm = false;
  EXPECT_THROW((void)CausalLM(llama, skyrl_tx::testing::random_weights(c, 4), tiny_options()), InvalidArgument);
}

TEST(CausalLM, UnsupportedArchitectureIsRejected) {
  ModelConfig c = skyrl_tx::testing::tiny_qwen3_config();
  WeightMap w = skyrl_tx::testing::random_weights(c, 6);
  c.architecture = "MistralForCausalLM";
  EXPECT_THROW((void)CausalLM(c, w, tiny_options()), Unimplemented);
}

}  // namespace
}  // namespace skyrl_tx::models
