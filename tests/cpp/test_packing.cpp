// Tests batching::pack_sequences / unpack_tokens: slot ordering, padding, masks, positions and input errors.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <functional>
#include <string>
#include <vector>

#include "batching/packing.h"
#include "common/errors.h"
#include "models/packed_attention.h"
#include "testing/tensor_asserts.h"

namespace skyrl_tx::batching {
namespace {

at::Tensor ids(std::vector<int64_t> v) { return at::tensor(v, at::kLong); }

// Expects InvalidArgument whose message contains every part.
void expect_invalid(const std::function<void()>& fn, const std::vector<std::string>& parts) {
  try {
    fn();
    ADD_FAILURE() << "no InvalidArgument thrown";
  } catch (const InvalidArgument& e) {
    for (const auto& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
  }
}

class PackingTest : public ::testing::Test {
 protected:
  // request i: slot, tokens (inputs i*10 + t, targets i*10 + t + 1)
  std::vector<int64_t> slots_ = {2, 0, 2, 1};
  std::vector<int64_t> lengths_ = {3, 5, 2, 4};
  std::vector<at::Tensor> inputs_, targets_;
  PackedBatch batch_;

  void SetUp() override {
    for (size_t i = 0; i < slots_.size(); ++i) {
      inputs_.push_back(at::arange(lengths_[i], at::kLong) + static_cast<int64_t>(i) * 10);
      targets_.push_back(inputs_.back() + 1);
    }
    batch_ = pack_sequences(inputs_, targets_, slots_, 100, at::kCPU);
  }
};

TEST_F(PackingTest, RowsAreStablySortedBySlot) {
  // slot 0: req 1; slot 1: req 3; slot 2: req 0 then req 2 (request order kept)
  EXPECT_EQ(batch_.packed_row, (std::vector<int64_t>{2, 0, 3, 1}));
  EXPECT_EQ(batch_.lengths, lengths_);
  ASSERT_EQ(batch_.input_ids.sizes(), at::IntArrayRef({4, 5}));
  EXPECT_EQ(batch_.input_ids.scalar_type(), at::kLong);
  for (size_t i = 0; i < slots_.size(); ++i) {
    const int64_t row = batch_.packed_row[i], len = lengths_[i];
    EXPECT_TENSOR_EQ(batch_.input_ids[row].narrow(0, 0, len), inputs_[i]);
    EXPECT_TENSOR_EQ(batch_.target_ids[row].narrow(0, 0, len), targets_[i]);
    EXPECT_EQ(batch_.input_ids[row].narrow(0, len, 5 - len).abs().sum().item<int64_t>(), 0) << "padding is 0";
    EXPECT_EQ(batch_.valid[row].sum().item<int64_t>(), len);
    EXPECT_TRUE(batch_.valid[row].narrow(0, 0, len).all().item<bool>());
  }
  const auto& segs = batch_.segments.segments();
  ASSERT_EQ(segs.size(), 3u);
  EXPECT_EQ(segs[0].slot, 0);
  EXPECT_EQ(segs[0].begin, 0);
  EXPECT_EQ(segs[0].length, 5);
  EXPECT_EQ(segs[1].slot, 1);
  EXPECT_EQ(segs[1].begin, 5);
  EXPECT_EQ(segs[2].slot, 2);
  EXPECT_EQ(segs[2].begin, 10);
  EXPECT_EQ(segs[2].length, 10);
  EXPECT_EQ(batch_.segments.num_tokens(), 20);
}

TEST_F(PackingTest, PositionsCountFromZero) {
  ASSERT_EQ(batch_.positions.sizes(), at::IntArrayRef({4, 5}));
  for (int64_t r = 0; r < 4; ++r) EXPECT_TENSOR_EQ(batch_.positions[r], at::arange(5, at::kLong));
}

TEST_F(PackingTest, RightPaddingNeedsNoMaskBeyondCausal) {
  // Every real token sits before its row's padding, so the causal mask alone keeps real queries on real keys
  // (CausalLMTest.PaddedBatchRowsEqualRowsAlone checks the hidden states).
  EXPECT_FALSE(batch_.mask.mask.defined());
  for (size_t i = 0; i < slots_.size(); ++i) {
    const int64_t row = batch_.packed_row[i], len = lengths_[i];
    EXPECT_TRUE(batch_.valid[row].narrow(0, 0, len).all().item<bool>()) << "row " << row;
    EXPECT_FALSE(batch_.valid[row].narrow(0, len, 5 - len).any().item<bool>()) << "row " << row;
  }
}

TEST_F(PackingTest, UnpackIsTheInverse) {
  std::vector<at::Tensor> back = unpack_tokens(batch_.input_ids.reshape({-1}), batch_);
  ASSERT_EQ(back.size(), inputs_.size());
  for (size_t i = 0; i < back.size(); ++i) EXPECT_TENSOR_EQ(back[i], inputs_[i]);
  // Per-token float outputs come back in request order with request lengths.
  at::Tensor flat = at::arange(20, at::kFloat);
  std::vector<at::Tensor> out = unpack_tokens(flat, batch_);
  EXPECT_TENSOR_EQ(out[0], at::arange(10, 13, at::kFloat));  // req 0 → packed row 2
  EXPECT_TENSOR_EQ(out[1], at::arange(0, 5, at::kFloat));    // req 1 → packed row 0
}

TEST_F(PackingTest, PackedLayoutPutsSequencesBackToBackBySlot) {
  PackedBatch b = pack_sequences(inputs_, targets_, slots_, 100, at::kCPU, RowLayout::kPacked);
  ASSERT_TRUE(b.packed());
  ASSERT_EQ(b.input_ids.sizes(), at::IntArrayRef({1, 14}));  // 3 + 5 + 2 + 4 tokens, no padding
  EXPECT_TRUE(b.valid.all().item<bool>());
  // Slot order (req 1, req 3, req 0, req 2), each sequence's positions restarting at 0.
  EXPECT_EQ(b.token_offset, (std::vector<int64_t>{9, 0, 12, 5}));
  EXPECT_EQ(b.packed_row, (std::vector<int64_t>{0, 0, 0, 0}));
  EXPECT_EQ(b.mask.sequence_starts, (std::vector<int64_t>{0, 5, 9, 12, 14}));
  EXPECT_TENSOR_EQ(b.mask.cu_seqlens, at::tensor({0, 5, 9, 12, 14}, at::kInt));
  EXPECT_EQ(b.mask.max_sequence_length, 5);
  EXPECT_FALSE(b.mask.mask.defined());
  for (size_t i = 0; i < slots_.size(); ++i) {
    const int64_t at = b.token_offset[i], len = lengths_[i];
    EXPECT_TENSOR_EQ(b.input_ids[0].narrow(0, at, len), inputs_[i]);
    EXPECT_TENSOR_EQ(b.target_ids[0].narrow(0, at, len), targets_[i]);
    EXPECT_TENSOR_EQ(b.positions[0].narrow(0, at, len), at::arange(len, at::kLong));
    EXPECT_TRUE((b.token_request.narrow(0, at, len) == static_cast<int64_t>(i)).all().item<bool>());
  }
  // Adapter segments follow the sequences' token counts: slot 0 [0, 5), slot 1 [5, 9), slot 2 [9, 14).
  const auto& segs = b.segments.segments();
  ASSERT_EQ(segs.size(), 3u);
  EXPECT_EQ(segs[0].begin, 0);
  EXPECT_EQ(segs[0].length, 5);
  EXPECT_EQ(segs[1].begin, 5);
  EXPECT_EQ(segs[1].length, 4);
  EXPECT_EQ(segs[2].slot, 2);
  EXPECT_EQ(segs[2].begin, 9);
  EXPECT_EQ(segs[2].length, 5);
  std::vector<at::Tensor> back = unpack_tokens(b.input_ids.reshape({-1}), b);
  for (size_t i = 0; i < back.size(); ++i) EXPECT_TENSOR_EQ(back[i], inputs_[i]);
}

TEST(Packing, PackedSequencesGoLongestFirstWithinAnAdapter) {
  // Slot 1: lengths 2, 4, 2 → 4, 2, 2 (equal lengths together, request order among them); slot 0 first.
  PackedBatch b = pack_sequences({ids({1, 2}), ids({1, 2, 3, 4}), ids({5, 6}), ids({7})},
                                 {ids({1, 2}), ids({1, 2, 3, 4}), ids({5, 6}), ids({7})}, {1, 1, 1, 0}, 10, at::kCPU,
                                 RowLayout::kPacked);
  EXPECT_EQ(b.token_offset, (std::vector<int64_t>{5, 1, 7, 0}));
  EXPECT_EQ(b.mask.sequence_starts, (std::vector<int64_t>{0, 1, 5, 7, 9}));
  std::vector<models::SequenceRun> runs = models::equal_length_runs(b.mask);
  ASSERT_EQ(runs.size(), 3u);  // [1], [4], [2, 2]
  EXPECT_EQ(runs[2].begin, 5);
  EXPECT_EQ(runs[2].count, 2);
  EXPECT_EQ(runs[2].length, 2);
  EXPECT_EQ(runs[0].count, 1);
  EXPECT_EQ(runs[1].length, 4);
}

TEST(Packing, PackedLayoutKeepsPaddedRowsWhenLengthsAreEqual) {
  // Equal lengths have no padding to save; one batched row per sequence runs one attention call.
  PackedBatch b = pack_sequences({ids({1, 2}), ids({3, 4})}, {ids({2, 3}), ids({4, 5})}, {0, 0}, 10, at::kCPU,
                                 RowLayout::kPacked);
  EXPECT_FALSE(b.packed());
  EXPECT_EQ(b.input_ids.sizes(), at::IntArrayRef({2, 2}));
  EXPECT_EQ(b.token_offset, (std::vector<int64_t>{0, 2}));
}

TEST_F(PackingTest, PaddedTokensBelongToTheirRowsRequest) {
  // sequence_log_ratio's datum index: padding names its row's request (and is masked by `valid`).
  for (size_t i = 0; i < slots_.size(); ++i) {
    EXPECT_EQ(batch_.token_offset[i], batch_.packed_row[i] * 5);
    EXPECT_TRUE((batch_.token_request.narrow(0, batch_.packed_row[i] * 5, 5) == static_cast<int64_t>(i))
                    .all().item<bool>());
  }
}

TEST(Packing, NoMaskWhenAllLengthsEqual) {
  PackedBatch b = pack_sequences({ids({1, 2, 3}), ids({4, 5, 6})}, {ids({2, 3, 4}), ids({5, 6, 7})}, {1, 1}, 10,
                                 at::kCPU);
  EXPECT_FALSE(b.mask.mask.defined());
  EXPECT_TRUE(b.valid.all().item<bool>());
  ASSERT_EQ(b.segments.segments().size(), 1u);
  EXPECT_EQ(b.segments.segments()[0].slot, 1);
  EXPECT_EQ(b.segments.num_tokens(), 6);
}

TEST(Packing, AcceptsInt32Tokens) {
  at::Tensor in = at::tensor({3, 4}, at::kInt);
  PackedBatch b = pack_sequences({in}, {in}, {0}, 5, at::kCPU);
  EXPECT_EQ(b.input_ids.scalar_type(), at::kLong);
  EXPECT_TENSOR_EQ(b.input_ids[0], ids({3, 4}));
}

TEST(Packing, RejectsEmptyOrMismatchedInput) {
  expect_invalid([] { pack_sequences({}, {}, {}, 10, at::kCPU); }, {"no sequences"});
  expect_invalid([] { pack_sequences({ids({1}), ids({})}, {ids({1}), ids({})}, {0, 0}, 10, at::kCPU); },
                 {"sequence 1", "empty"});
  expect_invalid([] { pack_sequences({ids({1, 2})}, {ids({1})}, {0}, 10, at::kCPU); }, {"sequence 0", "2", "1"});
  expect_invalid([] { pack_sequences({ids({1})}, {ids({1}), ids({2})}, {0}, 10, at::kCPU); }, {"must match"});
  expect_invalid([] { pack_sequences({ids({1})}, {ids({1})}, {0, 1}, 10, at::kCPU); }, {"must match"});
}

TEST(Packing, RejectsOutOfVocabTokens) {
  expect_invalid([] { pack_sequences({ids({1, 2}), ids({3, 57})}, {ids({1, 2}), ids({3, 4})}, {0, 0}, 50, at::kCPU); },
                 {"input_tokens[1]", "57", "50"});
  expect_invalid([] { pack_sequences({ids({1, 2})}, {ids({2, 50})}, {0}, 50, at::kCPU); },
                 {"target_tokens[0]", "50"});
  expect_invalid([] { pack_sequences({ids({-3, 2})}, {ids({2, 3})}, {0}, 50, at::kCPU); }, {"-3"});
}

TEST(Packing, RejectsNonIntegerOrNon1DTokens) {
  expect_invalid([] { pack_sequences({at::tensor({1.0f, 2.0f})}, {ids({1, 2})}, {0}, 10, at::kCPU); },
                 {"input_tokens[0]", "integer"});
  expect_invalid([] { pack_sequences({ids({1, 2})}, {at::ones({2}, at::kBool)}, {0}, 10, at::kCPU); },
                 {"target_tokens[0]", "integer"});
  expect_invalid([] { pack_sequences({ids({1, 2, 3, 4}).view({2, 2})}, {ids({1, 2})}, {0}, 10, at::kCPU); },
                 {"1-D"});
}

}  // namespace
}  // namespace skyrl_tx::batching
