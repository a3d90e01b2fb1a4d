// Target-token log-probabilities from hidden states, chunked so [tokens, vocab] logits never exist at once.
#include "loss/token_logprobs.h"

#include <algorithm>

#include "common/errors.h"

namespace skyrl_tx::loss {

at::Tensor target_logprobs(const lora::LoraLinear& lm_head, const at::Tensor& hidden, const at::Tensor& targets,
                           const lora::AdapterSegments& segments) {
  at::Tensor logits = lm_head.forward(hidden, segments).to(at::kFloat);  // [n, vocab]
  return logits.gather(1, targets.unsqueeze(1)).squeeze(1) - at::logsumexp(logits, 1);
}

at::Tensor token_logprobs(const lora::LoraLinear& lm_head, const at::Tensor& hidden, const at::Tensor& targets,
                          const lora::AdapterSegments& segments, int64_t chunk_tokens) {
  SKYRL_TX_CHECK(chunk_tokens > 0, InvalidArgument, "token_logprobs: chunk_tokens must be > 0 (got ", chunk_tokens, ")");
  const int64_t num_tokens = hidden.size(0);
  std::vector<at::Tensor> pieces;
  for (int64_t begin = 0; begin < num_tokens; begin += chunk_tokens) {
    const int64_t length = std::min(chunk_tokens, num_tokens - begin);
    pieces.push_back(target_logprobs(lm_head, hidden.narrow(0, begin, length), targets.narrow(0, begin, length),
                                     segments.slice(begin, length)));
  }
  if (pieces.empty()) return at::empty({0}, hidden.options().dtype(at::kFloat));
  return at::cat(pieces, 0);
}

}  // namespace skyrl_tx::loss
