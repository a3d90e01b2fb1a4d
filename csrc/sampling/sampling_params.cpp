// SamplingParams::validate: rejects a sample request's parameters before any compute is spent on it.
#include "sampling/sampling_params.h"

#include <cmath>

#include "common/errors.h"

namespace skyrl_tx::sampling {

void SamplingParams::validate(int64_t vocab_size) const {
  SKYRL_TX_CHECK(max_tokens >= 1, InvalidArgument, "sample: max_tokens must be >= 1 (got ", max_tokens, ")");
  // NaN fails every comparison, so finiteness is checked explicitly rather than relying on `>= 0`.
  SKYRL_TX_CHECK(std::isfinite(temperature) && temperature >= 0, InvalidArgument,
                 "sample: temperature must be finite and >= 0 (got ", temperature, ")");
  SKYRL_TX_CHECK(std::isfinite(top_p) && top_p > 0 && top_p <= 1, InvalidArgument,
                 "sample: top_p must be in (0, 1] (got ", top_p, ")");
  // top_k needs no check: <= 0 means off and a value above the vocabulary keeps every token.
  for (int64_t id : stop_tokens) {
    SKYRL_TX_CHECK(id >= 0 && id < vocab_size, InvalidArgument, "sample: stop_tokens must be token ids in [0, ",
                   vocab_size, ") (got ", id, ")");
  }
  for (size_t i = 0; i < stop_strings.size(); ++i) {
    // An empty stop string would match before the first token and end every sequence immediately.
    SKYRL_TX_CHECK(!stop_strings[i].empty(), InvalidArgument,
                   "sample: stop_strings must be non-empty (got \"\" at index ", i, ")");
  }
}

}  // namespace skyrl_tx::sampling
