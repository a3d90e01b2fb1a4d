// Tests models::ModelConfig::validate: valid Qwen3 / Llama configs pass, each bad field is named in the error.
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "common/errors.h"
#include "models/model_config.h"
#include "testing/tiny_model.h"

namespace skyrl_tx::models {
namespace {

using skyrl_tx::testing::tiny_llama_config;
using skyrl_tx::testing::tiny_qwen3_config;

// Runs validate() on a mutated Qwen3 config and checks the error type and that `field` is in what().
template <typename ErrorT>
void expect_rejects(const std::function<void(ModelConfig&)>& mutate, const std::string& field) {
  ModelConfig c = tiny_qwen3_config();
  mutate(c);
  try {
    c.validate();
    ADD_FAILURE() << "validate() accepted a config with a bad " << field;
  } catch (const ErrorT& e) {
    EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << "message: " << e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception type for " << field << ": " << e.what();
  }
}

TEST(ModelConfig, ValidConfigsPass) {
  EXPECT_NO_THROW(tiny_qwen3_config().validate());
  EXPECT_NO_THROW(tiny_llama_config().validate());
  ModelConfig mha = tiny_llama_config();
  mha.num_key_value_heads = mha.num_attention_heads;  // plain multi-head attention
  mha.head_dim = 0;
  EXPECT_NO_THROW(mha.validate());
}

TEST(ModelConfig, ResolvedHeadDim) {
  ModelConfig c = tiny_qwen3_config();
  EXPECT_EQ(c.resolved_head_dim(), 8);
  c.head_dim = 16;  // explicit head_dim need not equal hidden / heads (Qwen3 does this)
  EXPECT_EQ(c.resolved_head_dim(), 16);
  c.head_dim = 0;
  EXPECT_EQ(c.resolved_head_dim(), 32 / 4);
}

TEST(ModelConfig, UnsupportedArchitectureIsUnimplemented) {
  expect_rejects<Unimplemented>([](ModelConfig& c) { c.architecture = "GPT2LMHeadModel"; }, "architecture");
  expect_rejects<Unimplemented>([](ModelConfig& c) { c.architecture = ""; }, "architecture");
}

TEST(ModelConfig, NonPositiveSizesAreInvalid) {
  expect_rejects<InvalidArgument>([](ModelConfig& c) { c.vocab_size = 0; }, "vocab_size");
  expect_rejects<InvalidArgument>([](ModelConfig& c) { c.hidden_size = -1; }, "hidden_size");
  expect_rejects<InvalidArgument>([](ModelConfig& c) { c.intermediate_size = 0; }, "intermediate_size");
  expect_rejects<InvalidArgument>([](ModelConfig& c) { c.num_hidden_layers = 0; }, "num_hidden_layers");
  expect_rejects<InvalidArgument>([](ModelConfig& c) { c.num_attention_heads = 0; }, "num_attention_heads");
  expect_rejects<InvalidArgument>([](ModelConfig& c) { c.num_key_value_heads = 0; }, "num_key_value_heads");
}

TEST(ModelConfig, HeadsMustBeAMultipleOfKvHeads) {
  expect_rejects<InvalidArgument>([](ModelConfig& c) { c.num_key_value_heads = 3; }, "num_key_value_heads");
}

TEST(ModelConfig, OddHeadDimIsInvalid) {
  expect_rejects<InvalidArgument>([](ModelConfig& c) { c.head_dim = 7; }, "head_dim");
  // head_dim derived from hidden / heads: 36 / 4 = 9
  expect_rejects<InvalidArgument>(
      [](ModelConfig& c) {
        c.head_dim = 0;
        c.hidden_size = 36;
      },
      "head_dim");
}

TEST(ModelConfig, NonPositiveEpsAndThetaAreInvalid) {
  expect_rejects<InvalidArgument>([](ModelConfig& c) { c.rms_norm_eps = 0.0; }, "rms_norm_eps");
  expect_rejects<InvalidArgument>([](ModelConfig& c) { c.rope_theta = -1.0; }, "rope_theta");
}

TEST(ModelConfig, UnsupportedRopeTypeIsUnimplemented) {
  expect_rejects<Unimplemented>([](ModelConfig& c) { c.rope_scaling.type = "dynamic"; }, "dynamic");  // yarn: supported
  expect_rejects<Unimplemented>([](ModelConfig& c) { c.rope_scaling.type = "linear"; }, "rope");
  for (auto field : {&RopeScaling::factor, &RopeScaling::low_freq_factor}) {
    expect_rejects<InvalidArgument>([field](ModelConfig& c) {
      c.rope_scaling.type = "llama3";
      c.rope_scaling.*field = 0.0;  // a divisor / scale: zero would give inf frequencies, then NaN logits
    }, "rope_scaling");
  }
}

TEST(ModelConfig, Llama3FactorsMustBeOrdered) {
  expect_rejects<InvalidArgument>(
      [](ModelConfig& c) {
        c.rope_scaling.type = "llama3";
        c.rope_scaling.low_freq_factor = 4.0;
        c.rope_scaling.high_freq_factor = 4.0;
      },
      "high_freq_factor");
  // The same factors are irrelevant (not checked) for the default rope type.
  ModelConfig c = tiny_qwen3_config();
  c.rope_scaling.low_freq_factor = 4.0;
  c.rope_scaling.high_freq_factor = 1.0;
  EXPECT_NO_THROW(c.validate());
}

}  // namespace
}  // namespace skyrl_tx::models
