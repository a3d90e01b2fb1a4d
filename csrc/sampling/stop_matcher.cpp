// StopMatcher: per-sequence stop detection on token ids and on the completion's raw bytes.
#include "sampling/stop_matcher.h"

#include <algorithm>

#include "common/errors.h"

namespace skyrl_tx::sampling {

StopMatcher::StopMatcher(std::vector<int64_t> eos_tokens, std::vector<int64_t> stop_tokens,
                         std::vector<std::string> stop_strings, std::shared_ptr<const TokenBytes> token_bytes)
    : stop_ids_(std::move(eos_tokens)), stop_strings_(std::move(stop_strings)), token_bytes_(std::move(token_bytes)) {
  // Sorted and deduplicated so accept() can binary-search the union of EOS and stop tokens.
  stop_ids_.insert(stop_ids_.end(), stop_tokens.begin(), stop_tokens.end());
  std::sort(stop_ids_.begin(), stop_ids_.end());
  stop_ids_.erase(std::unique(stop_ids_.begin(), stop_ids_.end()), stop_ids_.end());
  SKYRL_TX_CHECK(stop_strings_.empty() || token_bytes_ != nullptr, InvalidArgument,
                 "sample: stop strings need the tokenizer's token bytes");
  for (const std::string& s : stop_strings_) {
    // An empty stop string would match before any token was generated.
    SKYRL_TX_CHECK(!s.empty(), InvalidArgument, "sample: stop_strings must be non-empty (got \"\")");
    max_stop_len_ = std::max(max_stop_len_, s.size());
  }
}

bool StopMatcher::accept(int64_t token) {
  // Stop ids come first: an EOS id need not have bytes (or even be inside the tokenizer's table).
  if (std::binary_search(stop_ids_.begin(), stop_ids_.end(), token)) return true;
  SKYRL_TX_CHECK(token >= 0, InvalidArgument, "sample: token id must be >= 0 (got ", token, ")");
  if (token_bytes_ != nullptr) {
    SKYRL_TX_CHECK(static_cast<size_t>(token) < token_bytes_->size(), InvalidArgument, "sample: token id ", token,
                   " is outside the tokenizer's ", token_bytes_->size(), " token bytes");
  }
  if (stop_strings_.empty()) return false;

  const size_t old_len = tail_.size();
  tail_ += (*token_bytes_)[static_cast<size_t>(token)];
  for (const std::string& s : stop_strings_) {
    // The previous call found no match, so a match now must end inside the new bytes: start the search
    // at most |s| - 1 bytes before them.
    const size_t from = old_len >= s.size() - 1 ? old_len - (s.size() - 1) : 0;
    if (tail_.find(s, from) != std::string::npos) return true;
  }
  // max_stop_len_ - 1 bytes suffice: any later match of length <= max_stop_len_ includes a new byte.
  const size_t keep = max_stop_len_ - 1;
  if (tail_.size() > keep) tail_.erase(0, tail_.size() - keep);
  return false;
}

}  // namespace skyrl_tx::sampling
