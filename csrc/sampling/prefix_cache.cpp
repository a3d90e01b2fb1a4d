// PrefixCache: LRU entries of (weights, tokens) -> KV cache row, longest-prefix lookup.
#include "sampling/prefix_cache.h"

#include <algorithm>

namespace skyrl_tx::sampling {
namespace {

int64_t common_prefix(const std::vector<int64_t>& a, const std::vector<int64_t>& b) {
  const auto mismatch = std::mismatch(a.begin(), a.begin() + static_cast<int64_t>(std::min(a.size(), b.size())),
                                      b.begin());
  return static_cast<int64_t>(mismatch.first - a.begin());
}

bool starts_with(const std::vector<int64_t>& whole, const std::vector<int64_t>& prefix) {
  return prefix.size() <= whole.size() && std::equal(prefix.begin(), prefix.end(), whole.begin());
}

}  // namespace

PrefixCache::Hit PrefixCache::lookup(const std::string& weights_key, const std::vector<int64_t>& prompt,
                                     int64_t limit) {
  Hit best;
  Entry* used = nullptr;
  if (weights_key.empty()) return best;
  for (Entry& e : entries_) {
    if (e.weights_key != weights_key) continue;
    const int64_t length = std::min(common_prefix(e.tokens, prompt), limit);
    if (length > best.length) {
      best = {e.row, length};
      used = &e;
    }
  }
  if (used != nullptr) used->last_used = ++clock_;
  return best;
}

std::vector<int64_t> PrefixCache::insert(const std::string& weights_key, std::vector<int64_t> tokens, int64_t row) {
  if (weights_key.empty() || tokens.empty()) return {row};
  std::vector<int64_t> released;
  for (const Entry& e : entries_) {
    if (e.weights_key == weights_key && starts_with(e.tokens, tokens)) return {row};  // nothing new
  }
  auto extended = std::remove_if(entries_.begin(), entries_.end(), [&](const Entry& e) {
    const bool gone = e.weights_key == weights_key && starts_with(tokens, e.tokens);  // the new entry covers it
    if (gone) released.push_back(e.row);
    return gone;
  });
  entries_.erase(extended, entries_.end());
  entries_.push_back({weights_key, std::move(tokens), row, ++clock_});
  return released;
}

int64_t PrefixCache::evict_lru(int64_t keep_row) {
  auto oldest = entries_.end();
  for (auto it = entries_.begin(); it != entries_.end(); ++it) {
    if (it->row != keep_row && (oldest == entries_.end() || it->last_used < oldest->last_used)) oldest = it;
  }
  if (oldest == entries_.end()) return -1;
  const int64_t row = oldest->row;
  entries_.erase(oldest);
  return row;
}

void PrefixCache::take(int64_t row) {
  entries_.erase(std::remove_if(entries_.begin(), entries_.end(), [&](const Entry& e) { return e.row == row; }),
                 entries_.end());
}

std::vector<int64_t> PrefixCache::drop(const std::string& weights_key) {
  std::vector<int64_t> rows;
  auto gone = std::remove_if(entries_.begin(), entries_.end(), [&](const Entry& e) {
    if (e.weights_key != weights_key) return false;
    rows.push_back(e.row);
    return true;
  });
  entries_.erase(gone, entries_.end());
  return rows;
}

}  // namespace skyrl_tx::sampling
