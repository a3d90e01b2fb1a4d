// Tests loss::token_logprobs: chunked log-softmax gather equals the unchunked formula, with and without LoRA.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "common/errors.h"
#include "lora/lora_linear.h"
#include "loss/token_logprobs.h"
#include "testing/tensor_asserts.h"
#include "testing/tiny_model.h"

namespace skyrl_tx::loss {
namespace {

using skyrl_tx::testing::make_gen;
using skyrl_tx::testing::randn;

constexpr int64_t kVocab = 37, kHidden = 16, kTokens = 12, kRank = 3;

class TokenLogprobsTest : public ::testing::Test {
 protected:
  TokenLogprobsTest()
      : gen_(make_gen(99)),
        weight_(randn({kVocab, kHidden}, gen_)),
        head_(weight_, at::Tensor(), /*num_slots=*/3, /*max_rank=*/kRank),
        hidden_(randn({kTokens, kHidden}, gen_)),
        targets_(at::randint(kVocab, {kTokens}, gen_, at::TensorOptions().dtype(at::kLong))) {}

  // log_softmax(logits).gather(targets) for a block of rows.
  static at::Tensor reference(const at::Tensor& logits, const at::Tensor& targets) {
    return at::log_softmax(logits, -1).gather(1, targets.unsqueeze(1)).squeeze(1);
  }

  at::Generator gen_;
  at::Tensor weight_;
  lora::LoraLinear head_;
  at::Tensor hidden_, targets_;
};

TEST_F(TokenLogprobsTest, AnyChunkSizeEqualsLogSoftmaxGather) {
  at::Tensor expected = reference(at::matmul(hidden_, weight_.t()), targets_);
  const auto segs = lora::AdapterSegments::uniform(0, kTokens);
  for (int64_t chunk : {int64_t{1}, int64_t{3}, int64_t{5}, kTokens, kTokens + 7}) {
    at::Tensor got = token_logprobs(head_, hidden_, targets_, segs, chunk);
    EXPECT_EQ(got.scalar_type(), at::kFloat);
    EXPECT_TENSOR_CLOSE(got, expected, 1e-5, 1e-5) << "chunk " << chunk;
  }
  // Log-probabilities are <= 0 and sum-exp over the vocab is 1 (sanity of the reference itself).
  EXPECT_TRUE((expected <= 0).all().item<bool>());
}

TEST_F(TokenLogprobsTest, LoraSegmentsUseTheirOwnHead) {
  // rows of 3 tokens: slots 0, 1, 1, 2 → segments [0,3) base, [3,9) slot 1, [9,12) slot 2
  const auto segs = lora::AdapterSegments::from_sorted_rows({0, 1, 1, 2}, 3);
  head_.enable_slot(1, kRank, 2.0, make_gen(1));
  head_.enable_slot(2, 2, 0.5, make_gen(2));
  at::Tensor a1 = randn({kRank, kHidden}, gen_), b1 = randn({kVocab, kRank}, gen_);
  at::Tensor a2 = randn({2, kHidden}, gen_), b2 = randn({kVocab, 2}, gen_);
  head_.set_factors(1, a1, b1);
  head_.set_factors(2, a2, b2);

  auto logits = [&](int64_t begin, int64_t len, const at::Tensor& a, const at::Tensor& b, double s) {
    at::Tensor h = hidden_.narrow(0, begin, len);
    at::Tensor out = at::matmul(h, weight_.t());
    if (a.defined()) out = out + s * at::matmul(at::matmul(h, a.t()), b.t());
    return out;
  };
  at::Tensor expected = at::cat({reference(logits(0, 3, at::Tensor(), at::Tensor(), 0), targets_.narrow(0, 0, 3)),
                                 reference(logits(3, 6, a1, b1, 2.0), targets_.narrow(0, 3, 6)),
                                 reference(logits(9, 3, a2, b2, 0.5), targets_.narrow(0, 9, 3))});
  // Chunks of 1, 3 (aligned), 4 and 5 (straddling segment boundaries), N and > N.
  for (int64_t chunk : {int64_t{1}, int64_t{3}, int64_t{4}, int64_t{5}, kTokens, kTokens + 1}) {
    EXPECT_TENSOR_CLOSE(token_logprobs(head_, hidden_, targets_, segs, chunk), expected, 1e-5, 1e-5)
        << "chunk " << chunk;
  }
  // The adapters matter: the base-only answer differs on the adapter rows.
  at::Tensor base = token_logprobs(head_, hidden_, targets_, lora::AdapterSegments::uniform(0, kTokens), 4);
  EXPECT_TENSOR_CLOSE(base.narrow(0, 0, 3), expected.narrow(0, 0, 3), 1e-5, 1e-5);
  EXPECT_FALSE(at::allclose(base.narrow(0, 3, 9), expected.narrow(0, 3, 9), 1e-3, 1e-3));
}

TEST_F(TokenLogprobsTest, Bf16HiddenIsUpcastBeforeSoftmax) {
  lora::LoraLinear head16(weight_.to(at::kBFloat16), at::Tensor(), 2, kRank);
  at::Tensor h16 = hidden_.to(at::kBFloat16);
  at::Tensor got = token_logprobs(head16, h16, targets_, lora::AdapterSegments::uniform(0, kTokens), 5);
  EXPECT_EQ(got.scalar_type(), at::kFloat);
  at::Tensor logits = at::linear(h16, weight_.to(at::kBFloat16)).to(at::kFloat);  // same bf16 logits
  EXPECT_TENSOR_CLOSE(got, reference(logits, targets_), 1e-5, 1e-4);
}

TEST_F(TokenLogprobsTest, EmptyInputAndBadChunk) {
  at::Tensor none = token_logprobs(head_, hidden_.narrow(0, 0, 0), targets_.narrow(0, 0, 0),
                                   lora::AdapterSegments(), 4);
  EXPECT_EQ(none.numel(), 0);
  EXPECT_THROW(token_logprobs(head_, hidden_, targets_, lora::AdapterSegments::uniform(0, kTokens), 0),
               InvalidArgument);
}

}  // namespace
}  // namespace skyrl_tx::loss
