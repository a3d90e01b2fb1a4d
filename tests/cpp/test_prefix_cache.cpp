// Tests sampling::PrefixCache: longest-prefix lookup per weights key, limits, dedup on insert, LRU eviction.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "sampling/prefix_cache.h"

namespace skyrl_tx::sampling {
namespace {

TEST(PrefixCache, LongestPrefixUnderTheSameWeightsWithinTheLimit) {
  PrefixCache cache;
  EXPECT_TRUE(cache.insert("w", {1, 2, 3, 4}, 0).empty());
  EXPECT_TRUE(cache.insert("w", {1, 2, 9}, 1).empty());
  EXPECT_TRUE(cache.insert("other", {1, 2, 3, 4, 5}, 2).empty());
  PrefixCache::Hit hit = cache.lookup("w", {1, 2, 3, 4, 5, 6}, 10);
  EXPECT_EQ(hit.row, 0);
  EXPECT_EQ(hit.length, 4);
  EXPECT_EQ(cache.lookup("w", {1, 2, 3, 4, 5, 6}, 3).length, 3);  // a limit short of the match
  EXPECT_EQ(cache.lookup("w", {1, 2, 9, 9}, 10).row, 1);
  EXPECT_EQ(cache.lookup("w", {7, 1, 2}, 10).row, -1);  // prefixes only
  EXPECT_EQ(cache.lookup("", {1, 2, 3}, 10).row, -1);   // the empty key never hits
  EXPECT_EQ(cache.insert("", {1, 2}, 5), std::vector<int64_t>{5});
}

TEST(PrefixCache, InsertKeepsOneRowPerPrefixChain) {
  PrefixCache cache;
  cache.insert("w", {1, 2, 3}, 0);
  EXPECT_EQ(cache.insert("w", {1, 2}, 1), std::vector<int64_t>{1});           // already held: the new row goes back
  EXPECT_EQ(cache.insert("w", {1, 2, 3, 4}, 2), std::vector<int64_t>{0});     // extends an entry: the old row goes
  EXPECT_EQ(cache.size(), 1);
  EXPECT_EQ(cache.lookup("w", {1, 2, 3, 4}, 10).row, 2);
}

TEST(PrefixCache, EvictsLeastRecentlyUsedButNeverTheKeptRow) {
  PrefixCache cache;
  cache.insert("w", {1}, 0);
  cache.insert("w", {2}, 1);
  cache.insert("w", {3}, 2);
  cache.lookup("w", {1, 5}, 10);  // row 0 used most recently now
  EXPECT_EQ(cache.evict_lru(/*keep_row=*/1), 2);
  EXPECT_EQ(cache.evict_lru(), 1);
  EXPECT_EQ(cache.evict_lru(/*keep_row=*/0), -1);
  EXPECT_EQ(cache.evict_lru(), 0);
  EXPECT_EQ(cache.evict_lru(), -1);
}

TEST(PrefixCache, DropForgetsOneWeightsKey) {
  PrefixCache cache;
  cache.insert("a", {1}, 0);
  cache.insert("b", {1}, 1);
  cache.insert("a", {2}, 2);
  std::vector<int64_t> rows = cache.drop("a");
  std::sort(rows.begin(), rows.end());
  EXPECT_EQ(rows, (std::vector<int64_t>{0, 2}));
  EXPECT_EQ(cache.lookup("a", {1}, 10).row, -1);
  EXPECT_EQ(cache.lookup("b", {1}, 10).row, 1);
}

}  // namespace
}  // namespace skyrl_tx::sampling
