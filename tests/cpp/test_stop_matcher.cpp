// Tests sampling::StopMatcher: EOS and stop tokens, stop strings split across tokens and across the kept tail.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "common/errors.h"
#include "sampling/stop_matcher.h"

namespace skyrl_tx::sampling {
namespace {

// A tiny byte-level vocabulary. "€" is E2 82 AC in UTF-8; ids 5 and 6 split it across two tokens.
std::shared_ptr<const TokenBytes> vocab() {
  return std::make_shared<const TokenBytes>(TokenBytes{
      "",                            // 0: EOS
      "Hel",                         // 1
      "lo",                          // 2
      " wor",                        // 3
      "ld",                          // 4
      "\xE2\x82",                    // 5: first two bytes of "€"
      "\xAC",                        // 6: last byte of "€"
      "x",                           // 7
      "a", "b", "c", "d", "e", "f",  // 8..13
      "12345abcd",                   // 14
      "xENDx",                       // 15
  });
}

// accept() over a token sequence, returning each call's answer.
std::vector<bool> feed(StopMatcher& m, const std::vector<int64_t>& tokens) {
  std::vector<bool> out;
  for (int64_t t : tokens) out.push_back(m.accept(t));
  return out;
}

std::vector<bool> stops_at_last(size_t n) {
  std::vector<bool> out(n, false);
  out.back() = true;
  return out;
}

TEST(StopMatcherTest, EosStops) {
  StopMatcher m({0}, {}, {}, nullptr);  // no stop strings: token bytes are optional
  EXPECT_EQ(feed(m, {7, 1, 2, 0}), stops_at_last(4));
  StopMatcher with_bytes({0, 4}, {}, {}, vocab());
  EXPECT_EQ(feed(with_bytes, {1, 2, 4}), stops_at_last(3));
}

TEST(StopMatcherTest, StopTokenStops) {
  StopMatcher m({0}, {7}, {}, nullptr);
  EXPECT_EQ(feed(m, {1, 2, 3, 7}), stops_at_last(4));
  StopMatcher eos_still_stops({0}, {7}, {}, nullptr);
  EXPECT_EQ(feed(eos_still_stops, {1, 0}), stops_at_last(2));
}

TEST(StopMatcherTest, StopStringAcrossTokensStopsAtTheCompletingToken) {
  StopMatcher m({0}, {}, {"lo wo"}, vocab());
  // "Hel" | "lo" | " wor": the string completes inside the third token, not earlier.
  EXPECT_EQ(feed(m, {1, 2, 3}), stops_at_last(3));
  StopMatcher inside_one_token({0}, {}, {"END"}, vocab());
  EXPECT_EQ(feed(inside_one_token, {1, 15}), stops_at_last(2));
}

TEST(StopMatcherTest, MultiByteCharacterSplitAcrossTokens) {
  StopMatcher m({0}, {}, {"x€"}, vocab());
  // x | E2 82 | AC: the partial character does not match; its last byte completes the stop string.
  EXPECT_EQ(feed(m, {7, 5, 6}), stops_at_last(3));
  StopMatcher euro({0}, {}, {"€"}, vocab());
  EXPECT_EQ(feed(euro, {1, 5, 6}), stops_at_last(3));
}

TEST(StopMatcherTest, MatchAcrossTheTrimmedTailBoundary) {
  // The longest stop string is 6 bytes, so only 5 bytes are kept between calls.
  StopMatcher long_token({0}, {}, {"zz", "abcdef"}, vocab());
  // "12345abcd" is trimmed to "5abcd"; "ef" then completes "abcdef" whose start was in the earlier token.
  EXPECT_EQ(feed(long_token, {14, 12, 13}), stops_at_last(3));

  StopMatcher byte_by_byte({0}, {}, {"zz", "abcdef"}, vocab());
  // Many trims first, then a match spanning six one-byte tokens.
  EXPECT_EQ(feed(byte_by_byte, {1, 2, 3, 4, 7, 7, 7, 8, 9, 10, 11, 12, 13}), stops_at_last(13));
}

TEST(StopMatcherTest, NoFalsePositive) {
  StopMatcher m({0}, {}, {"lo wo", "€x", "abcdef"}, vocab());
  // "lox wor", "€" not followed by "x", and "abcde" + "x" + "f": nothing matches.
  EXPECT_EQ(feed(m, {1, 2, 7, 3, 4, 5, 6, 1, 8, 9, 10, 11, 12, 7, 13, 14}), std::vector<bool>(16, false));
  // A stop string whose first bytes were already seen still needs its remainder.
  StopMatcher partial({0}, {}, {"Hello"}, vocab());
  EXPECT_EQ(feed(partial, {1, 7, 2}), std::vector<bool>(3, false));
}

TEST(StopMatcherTest, MissingTokenBytesWithStopStrings) {
  try {
    StopMatcher m({0}, {}, {"stop"}, nullptr);
    FAIL() << "no error without token bytes";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.message(), "sample: stop strings need the tokenizer's token bytes");
  }
}

TEST(StopMatcherTest, TokenOutsideTokenBytesIsInvalid) {
  StopMatcher m({0}, {}, {"stop"}, vocab());
  EXPECT_THROW(m.accept(16), InvalidArgument);
  EXPECT_THROW(m.accept(-1), InvalidArgument);
  // An EOS id needs no bytes.
  StopMatcher eos_beyond({1000}, {}, {"stop"}, vocab());
  EXPECT_TRUE(eos_beyond.accept(1000));
}

}  // namespace
}  // namespace skyrl_tx::sampling
