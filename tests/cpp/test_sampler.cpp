// Tests sampling::sample_tokens (greedy, temperature, top-k, top-p, batch independence) and SamplingParams::validate.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "common/errors.h"
#include "sampling/sampler.h"
#include "sampling/sampling_params.h"
#include "testing/tensor_asserts.h"
#include "testing/tiny_model.h"

namespace skyrl_tx::sampling {
namespace {

using skyrl_tx::testing::make_gen;
using skyrl_tx::testing::randn;

at::Tensor floats(const std::vector<float>& v) { return at::tensor(v, at::TensorOptions().dtype(at::kFloat)); }
at::Tensor longs(const std::vector<int64_t>& v) { return at::tensor(v, at::TensorOptions().dtype(at::kLong)); }

// The same temperature / top-k / top-p on every row, with the given uniforms ([B]).
RowSamplingParams uniform_params(const at::Tensor& u, double temperature, int64_t top_k = -1, double top_p = 1.0) {
  const int64_t b = u.size(0);
  return {at::full({b}, temperature, at::kFloat), at::full({b}, top_k, at::kLong), at::full({b}, top_p, at::kFloat),
          u.to(at::kFloat)};
}

// The midpoint grid u_i = (i + 0.5) / n: an exact quadrature of the inverse CDF.
at::Tensor grid(int64_t n) { return (at::arange(n, at::kDouble) + 0.5).div(n).to(at::kFloat); }

// Frequencies of each token id among the sampled tokens, as [V] float64.
at::Tensor frequencies(const at::Tensor& tokens, int64_t vocab) {
  return at::bincount(tokens, {}, vocab).to(at::kDouble) / static_cast<double>(tokens.size(0));
}

// Samples n grid uniforms from one logits row ([V]) and returns the empirical distribution.
at::Tensor empirical(const at::Tensor& row, int64_t n, double temperature, int64_t top_k = -1, double top_p = 1.0) {
  at::Tensor logits = row.unsqueeze(0).expand({n, row.size(0)}).contiguous();
  return frequencies(sample_tokens(logits, uniform_params(grid(n), temperature, top_k, top_p)).tokens, row.size(0));
}

TEST(SamplerTest, GreedyEqualsArgmaxIncludingTies) {
  auto gen = make_gen(1);
  at::Tensor random_rows = randn({4, 11}, gen);
  at::Tensor tied = floats({1, 3, 3, 0, -1, 3, 2, 2, 2, 0, 0,  //
                            5, 5, 5, 5, 5,  5, 5, 5, 5, 5, 5})
                        .view({2, 11});
  at::Tensor logits = at::cat({random_rows, tied});
  at::Tensor u = at::rand({6}, gen);
  SampledTokens out = sample_tokens(logits, uniform_params(u, 0.0));
  EXPECT_TENSOR_EQ(out.tokens, logits.argmax(-1));
  // Ties resolve to the lowest id.
  EXPECT_EQ(out.tokens[4].item<int64_t>(), 1);
  EXPECT_EQ(out.tokens[5].item<int64_t>(), 0);
}

TEST(SamplerTest, LogprobsEqualLogSoftmaxGather) {
  auto gen = make_gen(2);
  at::Tensor logits = randn({6, 40}, gen, 3.0);
  RowSamplingParams p{floats({0, 1, 0.7f, 1.5f, 1, 0.3f}), longs({-1, 0, 5, -1, 3, 40}),
                      floats({1, 1, 0.9f, 0.5f, 1, 0.95f}), at::rand({6}, gen)};
  SampledTokens out = sample_tokens(logits, p);
  ASSERT_EQ(out.logprobs.scalar_type(), at::kFloat);
  EXPECT_TENSOR_CLOSE(out.logprobs, at::log_softmax(logits, -1).gather(1, out.tokens.unsqueeze(1)).squeeze(1), 1e-6,
                      1e-6);

  // bfloat16 logits are computed in float32: logprobs match the float32 formula on the same values.
  at::Tensor bf16 = logits.to(at::kBFloat16);
  SampledTokens out16 = sample_tokens(bf16, p);
  ASSERT_EQ(out16.logprobs.scalar_type(), at::kFloat);
  EXPECT_TENSOR_CLOSE(out16.logprobs,
                      at::log_softmax(bf16.to(at::kFloat), -1).gather(1, out16.tokens.unsqueeze(1)).squeeze(1), 1e-6,
                      1e-6);
}

TEST(SamplerTest, TopK1EqualsGreedyForAnyUniform) {
  auto gen = make_gen(3);
  const int64_t n = 64;
  at::Tensor logits = randn({n, 30}, gen, 2.0);
  logits.index_put_({0, 7}, 100.0);  // a tie at the maximum in row 0
  logits.index_put_({0, 3}, 100.0);
  for (double temperature : {0.5, 1.0, 3.0}) {
    SampledTokens out = sample_tokens(logits, uniform_params(grid(n), temperature, /*top_k=*/1));
    EXPECT_TENSOR_EQ(out.tokens, logits.argmax(-1)) << "temperature " << temperature;
  }
  EXPECT_EQ(sample_tokens(logits, uniform_params(grid(n), 1.0, 1)).tokens[0].item<int64_t>(), 3);
}

TEST(SamplerTest, RowResultIndependentOfBatch) {
  auto gen = make_gen(4);
  const int64_t b = 7;
  at::Tensor logits = randn({b, 100}, gen, 2.0);
  RowSamplingParams p{floats({1, 0, 0.5f, 2, 1, 0.8f, 1.3f}), longs({-1, 5, 10, 0, 3, 50, 1}),
                      floats({1, 1, 0.7f, 0.9f, 0.2f, 1, 0.6f}), at::rand({b}, gen)};
  SampledTokens batched = sample_tokens(logits, p);
  for (int64_t i = 0; i < b; ++i) {
    auto row = [i](const at::Tensor& t) { return t.narrow(0, i, 1); };
    SampledTokens alone = sample_tokens(row(logits), {row(p.temperature), row(p.top_k), row(p.top_p), row(p.uniform)});
    EXPECT_TENSOR_EQ(alone.tokens, row(batched.tokens)) << "row " << i;
    EXPECT_TENSOR_EQ(alone.logprobs, row(batched.logprobs)) << "row " << i;
  }
  // And the same row placed among different neighbours, at a different position.
  at::Tensor others = randn({3, 100}, gen, 5.0);
  at::Tensor mixed = at::cat({others.narrow(0, 0, 2), logits.narrow(0, 2, 1), others.narrow(0, 2, 1)});
  RowSamplingParams pm{floats({0, 3, 0.5f, 1}), longs({0, 2, 10, -1}), floats({1, 0.1f, 0.7f, 1}),
                       at::cat({at::rand({2}, gen), p.uniform.narrow(0, 2, 1), at::rand({1}, gen)})};
  SampledTokens in_mixed = sample_tokens(mixed, pm);
  EXPECT_EQ(in_mixed.tokens[2].item<int64_t>(), batched.tokens[2].item<int64_t>());
  EXPECT_EQ(in_mixed.logprobs[2].item<float>(), batched.logprobs[2].item<float>());
}

TEST(SamplerTest, EmpiricalDistributionMatchesSoftmax) {
  auto gen = make_gen(5);
  const int64_t n = 4000, vocab = 9;
  at::Tensor row = randn({vocab}, gen, 1.5);
  // The grid puts each token's count within one of n * p, plus float rounding of the CDF.
  EXPECT_TENSOR_CLOSE(empirical(row, n, 1.0), at::softmax(row.to(at::kDouble), -1), 0, 1.5 / n);
}

TEST(SamplerTest, TemperatureScalesTheDistribution) {
  auto gen = make_gen(6);
  const int64_t n = 4000, vocab = 9;
  at::Tensor row = randn({vocab}, gen, 1.5);
  at::Tensor d = row.to(at::kDouble);
  EXPECT_TENSOR_CLOSE(empirical(row, n, 2.0), at::softmax(d / 2.0, -1), 0, 1.5 / n);
  EXPECT_TENSOR_CLOSE(empirical(row, n, 0.5), at::softmax(d / 0.5, -1), 0, 1.5 / n);
  // A very low temperature concentrates all mass on the argmax.
  at::Tensor cold =
      sample_tokens(row.unsqueeze(0).expand({n, vocab}).contiguous(), uniform_params(grid(n), 1e-4)).tokens;
  EXPECT_TENSOR_EQ(cold, at::full({n}, row.argmax().item<int64_t>(), at::kLong));
}

TEST(SamplerTest, TopK2OnlyReturnsTheTopTwo) {
  auto gen = make_gen(7);
  const int64_t n = 2000, vocab = 12;
  at::Tensor row = randn({vocab}, gen);
  at::Tensor top2 = std::get<1>(row.topk(2));
  at::Tensor freq = empirical(row, n, 1.5, /*top_k=*/2);
  // Renormalised over the top two (at temperature 1.5); every other token gets nothing.
  at::Tensor expected = at::zeros({vocab}, at::kDouble);
  expected.index_put_({top2}, at::softmax(row.index({top2}).to(at::kDouble) / 1.5, -1));
  EXPECT_TENSOR_CLOSE(freq, expected, 0, 1.5 / n);

  // Random rows and uniforms: the token is always one of the row's two largest logits.
  at::Tensor logits = randn({256, vocab}, gen, 0.3);
  at::Tensor tokens = sample_tokens(logits, uniform_params(at::rand({256}, gen), 5.0, 2)).tokens;
  at::Tensor top2_rows = std::get<1>(logits.topk(2, -1));
  EXPECT_TRUE((top2_rows == tokens.unsqueeze(1)).any(-1).all().item<bool>());
}

TEST(SamplerTest, TopPCutsTheTail) {
  const int64_t n = 2000;
  // probabilities 0.7, 0.2, 0.1 at ids 2, 0, 1
  at::Tensor row = floats({0.2f, 0.1f, 0.7f}).log();
  EXPECT_TENSOR_EQ(
      sample_tokens(row.unsqueeze(0).expand({n, 3}).contiguous(), uniform_params(grid(n), 1.0, -1, 0.3)).tokens,
      at::full({n}, 2, at::kLong));
  // top_p 0.8: the mass before id 1 is 0.9, so only ids 2 and 0 stay, renormalised to 0.7/0.9 and 0.2/0.9.
  EXPECT_TENSOR_CLOSE(empirical(row, n, 1.0, -1, 0.8), at::tensor({0.2 / 0.9, 0.0, 0.7 / 0.9}, at::kDouble), 0,
                      1.5 / n);
  // top_p 1 keeps everything.
  EXPECT_TENSOR_CLOSE(empirical(row, n, 1.0, -1, 1.0), at::tensor({0.2, 0.1, 0.7}, at::kDouble), 0, 1.5 / n);
}

TEST(SamplerTest, MaskedLogitsAreNeverSampled) {
  // -inf logits (e.g. masked tokens) keep zero mass even for u just below 1 with top_p = 1. In these rows
  // float rounding leaves the finite tokens' total mass just under 1, so a u of 1 - 2^-24 lies beyond it.
  const float inf = std::numeric_limits<float>::infinity();
  at::Tensor logits = floats({-0.4920932352542877f, -1.4157553911209106f, -0.21286803483963013f, -inf, -inf, -inf,
                              3.9294979572296143f, 1.535679578781128f, 3.97981858253479f, -inf, -inf, -inf,
                              0.4217257499694824f, 3.071772575378418f, -4.392016887664795f, -inf, -inf, -inf})
                          .view({3, 6});
  for (float u : {0.0f, 0.5f, 0.999999f, 0.99999994f}) {
    at::Tensor tokens = sample_tokens(logits, uniform_params(at::full({3}, u, at::kFloat), 1.0)).tokens;
    EXPECT_TRUE((tokens < 3).all().item<bool>()) << "u " << u << ": " << tokens;
  }
}

TEST(SamplerTest, CudaMatchesCpu) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  auto gen = make_gen(8);
  const int64_t b = 64;
  at::Tensor logits = randn({b, 500}, gen, 2.0);
  RowSamplingParams p{at::rand({b}, gen) * 2, at::randint(-1, 20, {b}, gen, at::kLong), at::rand({b}, gen) * 0.9 + 0.1,
                      grid(b)};
  p.temperature.narrow(0, 0, 4).zero_();
  SampledTokens cpu = sample_tokens(logits, p);
  SampledTokens cuda =
      sample_tokens(logits.cuda(), {p.temperature.cuda(), p.top_k.cuda(), p.top_p.cuda(), p.uniform.cuda()});
  ASSERT_TRUE(cuda.tokens.is_cuda());
  EXPECT_TENSOR_EQ(cuda.tokens, cpu.tokens);
  EXPECT_TENSOR_CLOSE(cuda.logprobs, cpu.logprobs, 1e-5, 1e-5);
}

// Expects validate() to throw InvalidArgument whose message names `field`.
void expect_invalid(const SamplingParams& p, const std::string& field) {
  try {
    p.validate(/*vocab_size=*/100);
    ADD_FAILURE() << "no error for bad " << field;
  } catch (const InvalidArgument& e) {
    EXPECT_NE(e.message().find(field), std::string::npos) << e.message();
    EXPECT_EQ(e.message().rfind("sample: ", 0), 0u) << e.message();
  }
}

TEST(SamplingParamsTest, ValidateRejectsEachBadField) {
  SamplingParams ok;
  ok.stop_tokens = {0, 99};
  ok.stop_strings = {"\n\n"};
  EXPECT_NO_THROW(ok.validate(100));
  for (int64_t top_k : {-5, -1, 0, 1, 100, 1000}) {
    SamplingParams p = ok;
    p.top_k = top_k;
    EXPECT_NO_THROW(p.validate(100)) << "top_k " << top_k;
  }
  SamplingParams greedy = ok;
  greedy.temperature = 0;
  EXPECT_NO_THROW(greedy.validate(100));

  auto with = [&](auto edit) {
    SamplingParams p = ok;
    edit(p);
    return p;
  };
  expect_invalid(with([](SamplingParams& p) { p.max_tokens = 0; }), "max_tokens");
  expect_invalid(with([](SamplingParams& p) { p.max_tokens = -3; }), "max_tokens");
  expect_invalid(with([](SamplingParams& p) { p.temperature = -0.1; }), "temperature");
  expect_invalid(with([](SamplingParams& p) { p.temperature = std::nan(""); }), "temperature");
  expect_invalid(with([](SamplingParams& p) { p.temperature = std::numeric_limits<double>::infinity(); }),
                 "temperature");
  expect_invalid(with([](SamplingParams& p) { p.top_p = 0; }), "top_p");
  expect_invalid(with([](SamplingParams& p) { p.top_p = 1.01; }), "top_p");
  expect_invalid(with([](SamplingParams& p) { p.top_p = std::nan(""); }), "top_p");
  expect_invalid(with([](SamplingParams& p) { p.stop_tokens = {5, 100}; }), "stop_tokens");
  expect_invalid(with([](SamplingParams& p) { p.stop_tokens = {-1}; }), "stop_tokens");
  expect_invalid(with([](SamplingParams& p) { p.stop_strings = {"ok", ""}; }), "stop_strings");
}

}  // namespace
}  // namespace skyrl_tx::sampling
