// Tests the gated delta rule (models/gated_deltanet.h): the chunked form equals the per-token recurrence it
// condenses (with an initial state, GQA-style value heads, lengths inside/across chunks), chunk size is invisible,
// and padding with g = beta = 0 leaves the state untouched.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "models/gated_deltanet.h"
#include "testing/tensor_asserts.h"
#include "testing/tiny_model.h"

namespace skyrl_tx::models {
namespace {

using skyrl_tx::testing::make_gen;
using skyrl_tx::testing::randn;

struct Inputs {
  at::Tensor q, k, v, g, beta, state;  // [B, T, Hk, Dk] x2, [B, T, Hv, Dv], [B, T, Hv] x2, [B, Hv, Dk, Dv]
};

Inputs make_inputs(int64_t batch, int64_t seq, uint64_t seed) {
  const int64_t key_heads = 2, value_heads = 4, key_dim = 8, value_dim = 6;
  at::Generator gen = make_gen(seed);
  Inputs in;
  in.q = randn({batch, seq, key_heads, key_dim}, gen);
  in.k = randn({batch, seq, key_heads, key_dim}, gen);
  in.v = randn({batch, seq, value_heads, value_dim}, gen);
  in.g = -at::softplus(randn({batch, seq, value_heads}, gen));  // log decay <= 0
  in.beta = at::sigmoid(randn({batch, seq, value_heads}, gen));
  in.state = randn({batch, value_heads, key_dim, value_dim}, gen, 0.5);
  return in;
}

// The reference: one recurrent step per token (transformers' torch_recurrent_gated_delta_rule, token by token).
std::pair<at::Tensor, at::Tensor> recurrence(const Inputs& in) {
  at::Tensor state = in.state.clone();
  std::vector<at::Tensor> outs;
  for (int64_t t = 0; t < in.q.size(1); ++t) {
    auto step = [&](const at::Tensor& x) { return x.narrow(1, t, 1); };
    outs.push_back(recurrent_gated_delta_step(step(in.q), step(in.k), step(in.v), step(in.g), step(in.beta), state));
  }
  return {at::cat(outs, 1), state};
}

class ChunkedEqualsRecurrence : public ::testing::TestWithParam<int64_t> {};

TEST_P(ChunkedEqualsRecurrence, OutputsAndFinalState) {
  const Inputs in = make_inputs(2, GetParam(), 1);
  auto [expected_out, expected_state] = recurrence(in);
  auto [out, state] = chunk_gated_delta_rule(in.q, in.k, in.v, in.g, in.beta, 16, in.state);
  EXPECT_TENSOR_CLOSE(out, expected_out, 1e-4, 1e-5);
  EXPECT_TENSOR_CLOSE(state, expected_state, 1e-4, 1e-5);
}

// Inside one chunk, exactly one, one past, several with a ragged tail.
INSTANTIATE_TEST_SUITE_P(Lengths, ChunkedEqualsRecurrence, ::testing::Values(1, 5, 16, 17, 50));

TEST(GatedDeltaRule, ChunkSizeDoesNotChangeTheResult) {
  const Inputs in = make_inputs(1, 37, 2);
  auto [a, state_a] = chunk_gated_delta_rule(in.q, in.k, in.v, in.g, in.beta, 8, in.state);
  auto [b, state_b] = chunk_gated_delta_rule(in.q, in.k, in.v, in.g, in.beta, 64, in.state);
  EXPECT_TENSOR_CLOSE(a, b, 1e-4, 1e-5);
  EXPECT_TENSOR_CLOSE(state_a, state_b, 1e-4, 1e-5);
}

TEST(GatedDeltaRule, PaddingWithoutDecayOrWriteKeepsTheState) {
  // What a packed prefill does past a row's end: g = beta = 0 there, so the final state is the one at its end.
  Inputs in = make_inputs(1, 20, 3);
  Inputs prefix = in;
  for (at::Tensor* t : {&prefix.q, &prefix.k, &prefix.v, &prefix.g, &prefix.beta}) *t = t->narrow(1, 0, 12);
  in.g.narrow(1, 12, 8).zero_();
  in.beta.narrow(1, 12, 8).zero_();
  auto [out, state] = chunk_gated_delta_rule(in.q, in.k, in.v, in.g, in.beta, 16, in.state);
  auto [prefix_out, prefix_state] = chunk_gated_delta_rule(prefix.q, prefix.k, prefix.v, prefix.g, prefix.beta, 16,
                                                           prefix.state);
  EXPECT_TENSOR_CLOSE(state, prefix_state, 1e-5, 1e-6);
  EXPECT_TENSOR_CLOSE(out.narrow(1, 0, 12), prefix_out, 1e-5, 1e-6);
}

TEST(GatedDeltaRule, GradientsFlowToEveryInput) {
  Inputs in = make_inputs(1, 20, 4);
  for (at::Tensor* t : {&in.q, &in.k, &in.v, &in.g, &in.beta}) t->requires_grad_(true);
  auto [out, state] = chunk_gated_delta_rule(in.q, in.k, in.v, in.g, in.beta, 8, at::Tensor());
  (out.pow(2).sum() + state.sum()).backward();
  for (const at::Tensor* t : {&in.q, &in.k, &in.v, &in.g, &in.beta}) {
    ASSERT_TRUE(t->grad().defined());
    EXPECT_GT(t->grad().abs().max().item<float>(), 0.0f);
    EXPECT_TRUE(t->grad().isfinite().all().item<bool>());
  }
}

}  // namespace
}  // namespace skyrl_tx::models
