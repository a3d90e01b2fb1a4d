// StopMatcher: decides after each generated token whether a sequence stops (EOS, stop token, stop string).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace skyrl_tx::sampling {

/// Raw bytes of every token id (what the tokenizer's decoder would emit for it alone), shared by all
/// matchers. Byte-level BPE tokens may be partial UTF-8; matching on bytes handles that.
using TokenBytes = std::vector<std::string>;

class StopMatcher {
 public:
  /// eos_tokens: the model's EOS ids (stop by default); stop_tokens / stop_strings: from SamplingParams.
  /// token_bytes may be null when there are no stop strings.
  StopMatcher(std::vector<int64_t> eos_tokens, std::vector<int64_t> stop_tokens, std::vector<std::string> stop_strings,
              std::shared_ptr<const TokenBytes> token_bytes);

  /// Feeds the next generated token. Returns true when the sequence must end *with* this token included
  /// (a stop token is returned once; a stop string ends the output right after the token completing it).
  bool accept(int64_t token);

 private:
  std::vector<int64_t> stop_ids_;
  std::vector<std::string> stop_strings_;
  std::shared_ptr<const TokenBytes> token_bytes_;
  std::string tail_;  // the last bytes of the completion, enough to match the longest stop string
  size_t max_stop_len_ = 0;
};

}  // namespace skyrl_tx::sampling
