// PrefixCache: finished sequences' KV cache rows kept for reuse. A later prompt that starts with the same tokens
// under the same immutable weights copies that prefix's K/V instead of prefilling it. Rows are the generator's
// scarce resource, so entries are evicted least recently used whenever a new request needs rows.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace skyrl_tx::sampling {

class PrefixCache {
 public:
  struct Hit {
    int64_t row = -1;    // the cache row holding the prefix (-1: no hit)
    int64_t length = 0;  // tokens of the prompt whose K/V it holds
  };

  /// The longest prefix of `prompt`, at most `limit` tokens, that an entry under `weights_key` holds (and marks that
  /// entry used). An empty key never hits: its weights may change (a live adapter, a training full model).
  Hit lookup(const std::string& weights_key, const std::vector<int64_t>& prompt, int64_t limit);
  /// Keeps `row`, whose positions [0, tokens.size()) hold the K/V of `tokens`. Returns the rows to release: `row`
  /// itself when an entry already holds `tokens` or a continuation of them, or the entries `tokens` extends.
  std::vector<int64_t> insert(const std::string& weights_key, std::vector<int64_t> tokens, int64_t row);
  /// Drops the least recently used entry whose row is not `keep_row` and returns its row (-1: none left).
  int64_t evict_lru(int64_t keep_row = -1);
  /// Removes the entry holding `row` without releasing the row: its new owner (a request that starts with the cached
  /// prefix and needs every row) keeps the K/V in place.
  void take(int64_t row);
  /// Drops every entry under `weights_key` (its weights are gone) and returns their rows.
  std::vector<int64_t> drop(const std::string& weights_key);
  int64_t size() const { return static_cast<int64_t>(entries_.size()); }

 private:
  struct Entry {
    std::string weights_key;
    std::vector<int64_t> tokens;
    int64_t row = -1;
    uint64_t last_used = 0;
  };
  std::vector<Entry> entries_;  // a handful (at most the generator's rows): linear scans are cheaper than an index
  uint64_t clock_ = 0;
};

}  // namespace skyrl_tx::sampling
