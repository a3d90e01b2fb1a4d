// Tests the gated delta rule (models/gated_deltanet.h): the chunked form equals the per-token recurrence it
// condenses (with an initial state, GQA-style value heads, lengths inside/across chunks), chunk size is invisible,
// and padding with g = beta = 0 leaves the state untouched; the fused CPU ops (the chunked rule with its derived
// backward, the decode steps of the delta rule and the conv, the conv + SiLU over whole sequences) equal their
// formulas.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "models/gated_deltanet.h"
#include "ops/chunk_gated_delta_rule_cpu.h"
#include "ops/conv_silu_cpu.h"
#include "ops/conv_step_cpu.h"
#include "ops/gated_delta_step_cpu.h"
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

// The chunked rule as one autograd Function (ops::chunk_gated_delta_rule_cpu) against the formula, forward and every
// gradient (q, k, v, g, beta, the initial state; upstream gradients on both the output and the final state). Cases:
// several chunks with GQA and a ragged tail, the bench's Qwen3.5 head size (Dk = Dv = 64, chunk 64), a sequence
// shorter than one chunk, and q, k, v as GatedDeltaNet passes them (narrowed out of one wider row per token) with g
// and beta strided.
TEST(GatedDeltaRule, FusedChunkedRuleEqualsTheFormulaWithGradients) {
  struct Case {
    int64_t batch, seq, key_heads, heads, key_dim, value_dim, chunk;
    bool initial_state, strided;
  };
  for (const Case& c : {Case{2, 37, 2, 4, 8, 6, 16, true, false}, Case{1, 130, 2, 4, 64, 64, 64, false, true},
                        Case{1, 5, 3, 3, 12, 20, 8, true, true}}) {
    SCOPED_TRACE(c.seq);
    at::Generator gen = make_gen(40 + c.seq);
    const int64_t qk = c.key_heads * c.key_dim, width = 2 * qk + c.heads * c.value_dim;
    const at::Tensor mixed = randn({c.batch, c.seq, width + 3}, gen);  // [B, T, conv_dim + spare]
    at::Tensor q0 = mixed.narrow(-1, 0, qk).reshape({c.batch, c.seq, c.key_heads, c.key_dim});
    at::Tensor k0 = mixed.narrow(-1, qk, qk).reshape({c.batch, c.seq, c.key_heads, c.key_dim});
    at::Tensor v0 = mixed.narrow(-1, 2 * qk, c.heads * c.value_dim).reshape({c.batch, c.seq, c.heads, c.value_dim});
    at::Tensor g0 = -at::softplus(randn({c.batch, c.heads, c.seq}, gen)) * 0.3;  // [B, H, T]: strided as [B, T, H]
    at::Tensor beta0 = at::sigmoid(randn({c.batch, c.heads, c.seq}, gen));
    g0 = c.strided ? g0.transpose(1, 2) : g0.transpose(1, 2).contiguous();
    beta0 = c.strided ? beta0.transpose(1, 2) : beta0.transpose(1, 2).contiguous();
    if (!c.strided) {
      q0 = q0.contiguous();
      k0 = k0.contiguous();
      v0 = v0.contiguous();
    }
    const at::Tensor state0 = c.initial_state ? randn({c.batch, c.heads, c.key_dim, c.value_dim}, gen, 0.5)
                                              : at::Tensor();
    const at::Tensor up_out = randn({c.batch, c.seq, c.heads, c.value_dim}, gen);
    const at::Tensor up_state = randn({c.batch, c.heads, c.key_dim, c.value_dim}, gen);
    ASSERT_TRUE(ops::chunk_gated_delta_rule_cpu_applies(q0, k0, v0, g0, beta0));
    {  // the strided inputs themselves, no autograd
      at::NoGradGuard no_grad;
      auto [out, state] = ops::chunk_gated_delta_rule_cpu(q0, k0, v0, g0, beta0, c.chunk, state0);
      auto [ref_out, ref_state] = chunk_gated_delta_rule_formula(q0, k0, v0, g0, beta0, c.chunk, state0);
      EXPECT_TENSOR_CLOSE(out, ref_out, 1e-4, 1e-5);
      EXPECT_TENSOR_CLOSE(state, ref_state, 1e-4, 1e-5);
    }
    std::vector<at::Tensor> fused, formula;  // q, k, v, g, beta[, state] as leaves
    for (std::vector<at::Tensor>* leaves : {&fused, &formula}) {
      for (const at::Tensor& x : {q0, k0, v0, g0, beta0}) leaves->push_back(x.clone().requires_grad_(true));
      if (c.initial_state) leaves->push_back(state0.clone().requires_grad_(true));
    }
    auto initial = [&](const std::vector<at::Tensor>& l) { return c.initial_state ? l[5] : at::Tensor(); };
    auto [out, state] =
        ops::chunk_gated_delta_rule_cpu(fused[0], fused[1], fused[2], fused[3], fused[4], c.chunk, initial(fused));
    auto [ref_out, ref_state] = chunk_gated_delta_rule_formula(formula[0], formula[1], formula[2], formula[3],
                                                               formula[4], c.chunk, initial(formula));
    ((out * up_out).sum() + (state * up_state).sum()).backward();
    ((ref_out * up_out).sum() + (ref_state * up_state).sum()).backward();
    const char* names[] = {"q", "k", "v", "g", "beta", "initial state"};
    for (size_t i = 0; i < fused.size(); ++i) {
      SCOPED_TRACE(names[i]);
      ASSERT_TRUE(fused[i].grad().defined());
      EXPECT_GT(formula[i].grad().abs().max().item<double>(), 0.0);
      EXPECT_TENSOR_CLOSE(fused[i].grad(), formula[i].grad(), 1e-4, 1e-4);
    }
  }
  EXPECT_FALSE(ops::chunk_gated_delta_rule_cpu_applies(at::zeros({1, 4, 1, 8}, at::kDouble),
                                                       at::zeros({1, 4, 1, 8}, at::kDouble), at::zeros({1, 4, 1, 8}),
                                                       at::zeros({1, 4, 1}), at::zeros({1, 4, 1})));
}

// One decode step's inputs laid out as GatedDeltaNet::forward makes them: q, k, v narrowed out of one wider row per
// token (the conv's output), the states a view of the first B rows of a cache with rows to spare.
struct StepInputs {
  at::Tensor q, k, v, g, beta, cache;  // cache: [B + 2, Hv, Dk, Dv]
};

StepInputs make_step(int64_t batch, int64_t key_heads, int64_t heads, int64_t key_dim, int64_t value_dim,
                     uint64_t seed) {
  at::Generator gen = make_gen(seed);
  const int64_t qk = key_heads * key_dim;
  const at::Tensor mixed = randn({batch, 1, 2 * qk + heads * value_dim + 3}, gen);  // [B, 1, conv_dim + spare]
  StepInputs in;
  in.q = mixed.narrow(-1, 0, qk).reshape({batch, 1, key_heads, key_dim});
  in.k = mixed.narrow(-1, qk, qk).reshape({batch, 1, key_heads, key_dim});
  in.v = mixed.narrow(-1, 2 * qk, heads * value_dim).reshape({batch, 1, heads, value_dim});
  in.g = -at::softplus(randn({batch, 1, heads}, gen));
  in.beta = at::sigmoid(randn({batch, 1, heads}, gen));
  in.cache = randn({batch + 2, heads, key_dim, value_dim}, gen, 0.5);
  return in;
}

// GQA at the bench's Qwen3.5 shape (8 value heads on 4 key heads of 64), one value head per key head with ragged
// vector tails (Dk 20, Dv 36), and narrow heads (Dv 6, under one vector); three steps each, so the second and third
// read a state the kernel wrote. The state of the rows past B must not move.
TEST(GatedDeltaRule, FusedCpuDecodeStepEqualsTheRecurrentFormula) {
  struct Case {
    int64_t batch, key_heads, heads, key_dim, value_dim;
  };
  c10::NoGradGuard no_grad;
  for (const Case& c : {Case{5, 4, 8, 64, 64}, Case{3, 3, 3, 20, 36}, Case{2, 2, 4, 8, 6}}) {
    const StepInputs in = make_step(c.batch, c.key_heads, c.heads, c.key_dim, c.value_dim, 7);
    at::Tensor fused_cache = in.cache.clone(), formula_cache = in.cache.clone();
    at::Tensor fused_state = fused_cache.narrow(0, 0, c.batch), formula_state = formula_cache.narrow(0, 0, c.batch);
    ASSERT_TRUE(ops::gated_delta_step_cpu_applies(fused_state));
    for (int step = 0; step < 3; ++step) {
      const at::Tensor out = ops::gated_delta_step_cpu(in.q, in.k, in.v, in.g, in.beta, fused_state);
      const at::Tensor expected = recurrent_gated_delta_step(in.q, in.k, in.v, in.g, in.beta, formula_state);
      ASSERT_EQ(out.sizes(), expected.sizes());
      EXPECT_TENSOR_CLOSE(out, expected, 1e-5, 1e-6);
      EXPECT_TENSOR_CLOSE(fused_cache, formula_cache, 1e-5, 1e-6);
    }
    EXPECT_TENSOR_EQ(fused_cache.narrow(0, c.batch, 2), in.cache.narrow(0, c.batch, 2));
  }
  // bfloat16 activations (a bf16 model on the CPU): both compute in float32 and round the output to bf16.
  const StepInputs in = make_step(2, 2, 4, 16, 16, 8);
  at::Tensor fused = in.cache.narrow(0, 0, 2).clone(), formula = fused.clone();
  const auto bf16 = [](const at::Tensor& t) { return t.to(at::kBFloat16); };
  const at::Tensor out = ops::gated_delta_step_cpu(bf16(in.q), bf16(in.k), bf16(in.v), in.g, bf16(in.beta), fused);
  const at::Tensor expected = recurrent_gated_delta_step(bf16(in.q), bf16(in.k), bf16(in.v), in.g, bf16(in.beta),
                                                         formula);
  EXPECT_EQ(out.scalar_type(), at::kBFloat16);
  EXPECT_TENSOR_CLOSE(out.to(at::kFloat), expected.to(at::kFloat), 1e-2, 1e-2);
  EXPECT_TENSOR_CLOSE(fused, formula, 1e-5, 1e-6);
}

// A row's step is its own: run alone it is the same bit for bit. Training, other state dtypes and a state whose head
// matrices are not contiguous keep the formula.
TEST(GatedDeltaRule, FusedCpuDecodeStepOfARowAloneEqualsItInABatchBitForBit) {
  c10::NoGradGuard no_grad;
  const StepInputs in = make_step(4, 4, 8, 64, 64, 9);
  at::Tensor whole = in.cache.narrow(0, 0, 4).clone();
  const at::Tensor out = ops::gated_delta_step_cpu(in.q, in.k, in.v, in.g, in.beta, whole);
  for (int64_t b = 0; b < 4; ++b) {
    at::Tensor alone = in.cache.narrow(0, b, 1).clone();
    const auto row = [b](const at::Tensor& t) { return t.narrow(0, b, 1); };
    EXPECT_TENSOR_EQ(ops::gated_delta_step_cpu(row(in.q), row(in.k), row(in.v), row(in.g), row(in.beta), alone),
                     out.narrow(0, b, 1));
    EXPECT_TENSOR_EQ(alone, whole.narrow(0, b, 1));
  }
  EXPECT_FALSE(ops::gated_delta_step_cpu_applies(whole.to(at::kDouble)));
  EXPECT_FALSE(ops::gated_delta_step_cpu_applies(whole.transpose(2, 3)));
  c10::AutoGradMode training(true);
  EXPECT_FALSE(ops::gated_delta_step_cpu_applies(whole));
}

// The conv's decode step: a strided x (a transposed projection, as GatedDeltaNet::conv passes it), states a view of a
// cache's first rows, three chained tokens (each reads the state the last one shifted), then a kernel of 2 (one kept
// input). The products are the formula's; only the 4-term sum may round in another order.
TEST(GatedDeltaRule, FusedCpuConvStepEqualsTheFormula) {
  c10::NoGradGuard no_grad;
  for (const int64_t kernel : {4, 2}) {
    at::Generator gen = make_gen(10 + kernel);
    const int64_t batch = 3, channels = 37;
    const at::Tensor weight = randn({channels, kernel}, gen);
    const at::Tensor cache = randn({batch + 2, channels, kernel - 1}, gen);
    at::Tensor fused_cache = cache.clone(), formula_cache = cache.clone();
    at::Tensor fused = fused_cache.narrow(0, 0, batch), formula = formula_cache.narrow(0, 0, batch);
    ASSERT_TRUE(ops::conv_step_cpu_applies(fused, weight));
    for (int step = 0; step < 3; ++step) {
      const at::Tensor x = randn({batch, 1, channels}, gen).transpose(1, 2);  // [B, C, 1], strided
      EXPECT_TENSOR_CLOSE(ops::conv_step_cpu(x, fused, weight), causal_conv_step(x, formula, weight), 1e-5, 1e-6);
      EXPECT_TENSOR_EQ(fused_cache, formula_cache);  // the shift moves values, it computes nothing
    }
    EXPECT_TENSOR_EQ(fused_cache.narrow(0, batch, 2), cache.narrow(0, batch, 2));
  }
  const at::Tensor state = at::zeros({2, 8, 3});
  EXPECT_FALSE(ops::conv_step_cpu_applies(state.to(at::kBFloat16), at::zeros({8, 4})));
  EXPECT_FALSE(ops::conv_step_cpu_applies(at::zeros({2, 3, 8}).transpose(1, 2), at::zeros({8, 4})));
  c10::AutoGradMode training(true);
  EXPECT_FALSE(ops::conv_step_cpu_applies(state, at::zeros({8, 4})));
}

// The conv + SiLU over whole sequences, forward and both gradients: x a packed run's view ([count, len, C] of a wider
// row, as GatedDeltaNet::forward passes it), a ragged channel tail (C = 37), sequences shorter than the kernel.
TEST(GatedDeltaRule, FusedCpuConvSiluEqualsConv1dThenSilu) {
  struct Case {
    int64_t batch, tokens, channels, kernel;
  };
  for (const Case& c : {Case{3, 20, 37, 4}, Case{2, 2, 64, 4}, Case{1, 9, 16, 2}}) {
    at::Generator gen = make_gen(20 + c.tokens);
    const at::Tensor row = randn({1, c.batch * c.tokens + 5, c.channels}, gen);  // [1, N, C]: the run, then more
    const at::Tensor x0 = row.narrow(1, 0, c.batch * c.tokens).squeeze(0).unflatten(0, {c.batch, c.tokens});
    const at::Tensor w0 = randn({c.channels, c.kernel}, gen, 0.5), upstream = randn({c.batch, c.tokens, c.channels},
                                                                                     gen);
    at::Tensor x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
    at::Tensor rx = x0.clone().requires_grad_(true), rw = w0.clone().requires_grad_(true);
    ASSERT_TRUE(ops::conv_silu_cpu_applies(x0, w0));
    const at::Tensor out = ops::conv_silu_cpu(x0, w0);  // the strided view itself, no autograd
    const at::Tensor expected = causal_conv_silu(rx, rw);
    EXPECT_TENSOR_CLOSE(out, expected, 1e-5, 1e-6);
    (ops::conv_silu_cpu(x, w) * upstream).sum().backward();
    (expected * upstream).sum().backward();
    EXPECT_TENSOR_CLOSE(x.grad(), rx.grad(), 1e-5, 1e-5);
    EXPECT_TENSOR_CLOSE(w.grad(), rw.grad(), 1e-4, 1e-5);
  }
  EXPECT_FALSE(ops::conv_silu_cpu_applies(at::zeros({2, 3, 8}, at::kDouble), at::zeros({8, 4})));
  EXPECT_FALSE(ops::conv_silu_cpu_applies(at::zeros({2, 8, 3}).transpose(1, 2), at::zeros({8, 4})));
}

// The gated norm after the rule (Qwen3_5RMSNormGated): in float32 on the CPU, fused RMSNorm then fused SiLU-times;
// output and gradients to x, the gate and the (trained) weight equal the formula's.
TEST(GatedDeltaRule, GatedRmsNormEqualsItsFormulaWithGradients) {
  at::Generator gen = make_gen(30);
  const at::Tensor x0 = randn({24, 36}, gen, 2.0), gate0 = randn({24, 36}, gen), w0 = 1.0 + randn({36}, gen, 0.1);
  const at::Tensor upstream = randn({24, 36}, gen);
  at::Tensor x = x0.clone().requires_grad_(true), gate = gate0.clone().requires_grad_(true);
  at::Tensor w = w0.clone().requires_grad_(true);
  at::Tensor rx = x0.clone().requires_grad_(true), rgate = gate0.clone().requires_grad_(true);
  at::Tensor rw = w0.clone().requires_grad_(true);
  const at::Tensor out = GatedRmsNorm(w, 1e-6).forward(x, gate);
  const at::Tensor expected = rw * (rx / at::sqrt(rx.pow(2).mean(-1, true) + 1e-6)) * at::silu(rgate);
  EXPECT_TENSOR_CLOSE(out, expected, 1e-5, 1e-6);
  (out * upstream).sum().backward();
  (expected * upstream).sum().backward();
  EXPECT_TENSOR_CLOSE(x.grad(), rx.grad(), 1e-5, 1e-5);
  EXPECT_TENSOR_CLOSE(gate.grad(), rgate.grad(), 1e-5, 1e-5);
  EXPECT_TENSOR_CLOSE(w.grad(), rw.grad(), 1e-5, 1e-5);
}

}  // namespace
}  // namespace skyrl_tx::models
