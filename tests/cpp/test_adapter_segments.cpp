// Tests lora::AdapterSegments: building from sorted rows, slicing, token counts and the base-only check.
#include <gtest/gtest.h>

#include "common/errors.h"
#include "lora/adapter_segments.h"

namespace skyrl_tx::lora {
namespace {

void expect_segment(const Segment& s, int64_t slot, int64_t begin, int64_t length) {
  EXPECT_EQ(s.slot, slot);
  EXPECT_EQ(s.begin, begin);
  EXPECT_EQ(s.length, length);
}

TEST(AdapterSegments, FromSortedRowsMergesEqualSlots) {
  // rows: slot 0, 0, 2, 2, 2, 5 with 4 tokens each
  AdapterSegments segs = AdapterSegments::from_sorted_rows({0, 0, 2, 2, 2, 5}, 4);
  ASSERT_EQ(segs.segments().size(), 3u);
  expect_segment(segs.segments()[0], 0, 0, 8);
  expect_segment(segs.segments()[1], 2, 8, 12);
  expect_segment(segs.segments()[2], 5, 20, 4);
  EXPECT_EQ(segs.num_tokens(), 24);
  EXPECT_FALSE(segs.only_base());
}

TEST(AdapterSegments, FromSortedRowsSingleRowAndEmpty) {
  AdapterSegments one = AdapterSegments::from_sorted_rows({3}, 7);
  ASSERT_EQ(one.segments().size(), 1u);
  expect_segment(one.segments()[0], 3, 0, 7);

  AdapterSegments none = AdapterSegments::from_sorted_rows({}, 7);
  EXPECT_TRUE(none.segments().empty());
  EXPECT_EQ(none.num_tokens(), 0);
}

TEST(AdapterSegments, FromUnsortedRowsThrowsInternal) {
  EXPECT_THROW(AdapterSegments::from_sorted_rows({1, 0}, 2), Internal);
  EXPECT_THROW(AdapterSegments::from_sorted_rows({0, 2, 2, 1}, 3), Internal);
}

TEST(AdapterSegments, Uniform) {
  AdapterSegments segs = AdapterSegments::uniform(4, 10);
  ASSERT_EQ(segs.segments().size(), 1u);
  expect_segment(segs.segments()[0], 4, 0, 10);
  EXPECT_EQ(segs.num_tokens(), 10);
  EXPECT_FALSE(segs.only_base());
  EXPECT_TRUE(AdapterSegments::uniform(0, 10).only_base());
}

TEST(AdapterSegments, OnlyBase) {
  EXPECT_TRUE(AdapterSegments::from_sorted_rows({0, 0, 0}, 5).only_base());
  EXPECT_FALSE(AdapterSegments::from_sorted_rows({0, 0, 1}, 5).only_base());
  EXPECT_TRUE(AdapterSegments().only_base());
}

TEST(AdapterSegments, SliceClipsAndRebasesAcrossBoundaries) {
  // [slot 0: 0..8) [slot 2: 8..20) [slot 5: 20..24)
  AdapterSegments segs = AdapterSegments::from_sorted_rows({0, 0, 2, 2, 2, 5}, 4);

  AdapterSegments mid = segs.slice(6, 16);  // tokens 6..22: 2 of slot 0, 12 of slot 2, 2 of slot 5
  ASSERT_EQ(mid.segments().size(), 3u);
  expect_segment(mid.segments()[0], 0, 0, 2);
  expect_segment(mid.segments()[1], 2, 2, 12);
  expect_segment(mid.segments()[2], 5, 14, 2);
  EXPECT_EQ(mid.num_tokens(), 16);

  AdapterSegments inside = segs.slice(10, 3);  // strictly inside slot 2
  ASSERT_EQ(inside.segments().size(), 1u);
  expect_segment(inside.segments()[0], 2, 0, 3);

  AdapterSegments exact = segs.slice(8, 12);  // exactly the slot-2 segment
  ASSERT_EQ(exact.segments().size(), 1u);
  expect_segment(exact.segments()[0], 2, 0, 12);

  AdapterSegments tail = segs.slice(20, 100);  // clipped at the end of the batch
  ASSERT_EQ(tail.segments().size(), 1u);
  expect_segment(tail.segments()[0], 5, 0, 4);
  EXPECT_EQ(tail.num_tokens(), 4);

  AdapterSegments base_part = segs.slice(0, 5);
  EXPECT_TRUE(base_part.only_base());
  EXPECT_EQ(base_part.num_tokens(), 5);

  EXPECT_TRUE(segs.slice(24, 5).segments().empty());
  EXPECT_TRUE(segs.slice(3, 0).segments().empty());
}

TEST(AdapterSegments, SlicesTileTheBatch) {
  AdapterSegments segs = AdapterSegments::from_sorted_rows({0, 1, 1, 3}, 5);
  int64_t total = 0;
  for (int64_t begin = 0; begin < segs.num_tokens(); begin += 3) {
    AdapterSegments piece = segs.slice(begin, 3);
    int64_t expected_begin = 0;
    for (const Segment& s : piece.segments()) {
      EXPECT_EQ(s.begin, expected_begin);  // contiguous and rebased
      expected_begin += s.length;
    }
    total += piece.num_tokens();
  }
  EXPECT_EQ(total, segs.num_tokens());
}

}  // namespace
}  // namespace skyrl_tx::lora
