// Target-token log-probabilities from hidden states, chunked so [tokens, vocab] logits never exist at once.
#include "loss/token_logprobs.h"

#include <algorithm>

#include "common/errors.h"

namespace skyrl_tx::loss {

at::Tensor target_logprobs(const OutputHead& head, const at::Tensor& hidden, const at::Tensor& targets,
                           const lora::AdapterSegments& segments) {
  const dist::TensorParallel& tp = head.tensor_parallel;
  if (!tp.enabled()) {
    at::Tensor logits = head.lm_head.forward(hidden, segments).to(at::kFloat);  // [n, vocab]
    return logits.gather(1, targets.unsqueeze(1)).squeeze(1) - at::logsumexp(logits, 1);
  }
  at::Tensor logits = head.lm_head.forward(tp.copy_in(hidden), segments).to(at::kFloat);  // [n, vocab shard]
  // The shift only keeps exp() in range: no gradient through it (as in logsumexp).
  const at::Tensor shift = tp.max(std::get<0>(logits.detach().max(1)));  // [n]
  const at::Tensor sum_exp = tp.reduce_out((logits - shift.unsqueeze(1)).exp().sum(1));  // [n]
  const at::Tensor local = targets - head.vocab.begin;  // [n]; in [0, length) where this rank holds the target
  const at::Tensor here = (local >= 0).logical_and(local < head.vocab.length);
  const at::Tensor picked = logits.gather(1, local.clamp(0, head.vocab.length - 1).unsqueeze(1)).squeeze(1);
  const at::Tensor target_logit = tp.reduce_out(at::where(here, picked, at::zeros_like(picked)));  // [n]
  return target_logit - shift - sum_exp.log();
}

at::Tensor token_logprobs(const OutputHead& head, const at::Tensor& hidden, const at::Tensor& targets,
                          const lora::AdapterSegments& segments, int64_t chunk_tokens) {
  SKYRL_TX_CHECK(chunk_tokens > 0, InvalidArgument, "token_logprobs: chunk_tokens must be > 0 (got ", chunk_tokens, ")");
  const int64_t num_tokens = hidden.size(0);
  std::vector<at::Tensor> pieces;
  for (int64_t begin = 0; begin < num_tokens; begin += chunk_tokens) {
    const int64_t length = std::min(chunk_tokens, num_tokens - begin);
    pieces.push_back(target_logprobs(head, hidden.narrow(0, begin, length), targets.narrow(0, begin, length),
                                     segments.slice(begin, length)));
  }
  if (pieces.empty()) return at::empty({0}, hidden.options().dtype(at::kFloat));
  return at::cat(pieces, 0);
}

}  // namespace skyrl_tx::loss
