// sample_tokens: batched greedy / temperature / top-k / top-p token choice by inverse CDF, without host syncs.
#include "sampling/sampler.h"

#include <limits>

#include "common/dtype.h"
#include "common/errors.h"

namespace skyrl_tx::sampling {
namespace {

// A per-row parameter as a [B, 1] tensor on the logits' device, ready to broadcast against [B, V].
at::Tensor row_param(const at::Tensor& t, const char* name, int64_t rows, const at::Tensor& logits,
                     at::ScalarType dtype) {
  SKYRL_TX_CHECK(t.defined() && t.dim() == 1 && t.size(0) == rows, InvalidArgument, "sample: ", name,
                 " must have shape [", rows, "] (got ", t.defined() ? shape_str(t) : std::string("undefined"), ")");
  return t.to(logits.device(), dtype).unsqueeze(1);
}

// Rows with top-k / top-p: the kept tokens are a prefix of the vocabulary sorted by descending logit.
at::Tensor sample_truncated(const at::Tensor& scaled, const at::Tensor& top_k, const at::Tensor& top_p,
                            const at::Tensor& uniform) {
  const int64_t vocab = scaled.size(1);
  // Stable descending sort: equal logits keep ascending id order, so ties resolve to the lowest id.
  auto [sorted, sorted_ids] = at::sort(scaled, /*stable=*/true, /*dim=*/-1, /*descending=*/true);  // [B, V] each
  at::Tensor position = at::arange(vocab, scaled.options().dtype(at::kLong)).unsqueeze(0);         // [1, V]
  at::Tensor in_top_k = (top_k <= 0) | (position < top_k);                                         // [B, V]
  at::Tensor probs =
      at::softmax(sorted.masked_fill(in_top_k.logical_not(), -std::numeric_limits<float>::infinity()), -1);  // [B, V]

  // Nucleus: a position stays while the mass strictly before it is below top_p. Zero-mass positions (top-k
  // masked, -inf logits, underflow) are dropped: float rounding can leave the mass before them just under
  // top_p = 1, and keeping them would let the clamp below land on one when the kept total rounds below u.
  // Probabilities are non-increasing along the sorted axis, so the kept positions form a prefix.
  at::Tensor mass_before = at::cumsum(probs, -1) - probs;                     // [B, V]
  at::Tensor keep = ((mass_before < top_p) & (probs > 0)) | (position == 0);  // [B, V]
  at::Tensor kept = at::where(keep, probs, at::zeros_like(probs));

  // Inverse CDF walked in token-id order, not probability order: two tokens whose probabilities tie in
  // float32 may swap places in the sort under the ~1e-6 logit noise of another batch shape, and the same
  // draw would then pick the other token. In id order a seeded draw is stable against such swaps.
  at::Tensor kept_by_id = at::zeros_like(kept).scatter(1, sorted_ids, kept);           // [B, V]
  at::Tensor keep_by_id = at::zeros_like(keep).scatter(1, sorted_ids, keep);           // [B, V]
  at::Tensor cdf = at::cumsum(kept_by_id / kept_by_id.sum(-1, /*keepdim=*/true), -1);  // [B, V]
  // The first id whose cumulative mass exceeds u (flat stretches are zero-mass ids, never chosen); when
  // rounding leaves the total just below u, the last kept id is taken.
  at::Tensor last_kept = at::where(keep_by_id, position, at::zeros_like(position)).amax(-1, /*keepdim=*/true);
  return at::minimum((cdf <= uniform).sum(-1, /*keepdim=*/true), last_kept).squeeze(1);             // [B]
}

}  // namespace

SampledTokens sample_tokens(const at::Tensor& logits, const RowSamplingParams& params) {
  SKYRL_TX_CHECK(logits.defined() && logits.dim() == 2 && logits.size(1) >= 1, InvalidArgument,
                 "sample: logits must have shape [B, V] with V >= 1 (got ",
                 logits.defined() ? shape_str(logits) : std::string("undefined"), ")");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  at::Tensor x = logits.to(at::kFloat);                                                        // [B, V]
  at::Tensor temperature = row_param(params.temperature, "temperature", rows, x, at::kFloat);  // [B, 1]
  at::Tensor top_k = row_param(params.top_k, "top_k", rows, x, at::kLong);                     // [B, 1]
  at::Tensor top_p = row_param(params.top_p, "top_p", rows, x, at::kFloat);                    // [B, 1]
  at::Tensor uniform = row_param(params.uniform, "uniform", rows, x, at::kFloat);              // [B, 1]

  // Greedy rows divide by 1 instead of 0 so the sampled branch stays finite; where() below discards it.
  at::Tensor greedy = temperature.squeeze(1) == 0;                                              // [B] bool
  at::Tensor scaled = x / at::where(temperature > 0, temperature, at::ones_like(temperature));  // [B, V]
  at::Tensor ids = at::arange(vocab, x.options().dtype(at::kLong)).unsqueeze(0);                // [1, V]

  // Rows without top-k / top-p: the inverse CDF of softmax(scaled) over token ids, no sort needed. The first
  // id whose cumulative mass exceeds u (zero-mass ids form flat stretches and are never chosen); when rounding
  // leaves the total just below u, the last id of nonzero mass is taken.
  at::Tensor probs_by_id = at::softmax(scaled, -1);                                              // [B, V]
  at::Tensor last_nonzero = at::where(probs_by_id > 0, ids, at::zeros_like(ids)).amax(-1, /*keepdim=*/true);
  at::Tensor sampled = at::minimum((at::cumsum(probs_by_id, -1) <= uniform).sum(-1, /*keepdim=*/true),
                                   last_nonzero).squeeze(1);  // [B]
  if (!params.all_untruncated) {
    at::Tensor truncated = ((top_k > 0) | (top_p < 1)).squeeze(1);  // [B] bool
    sampled = at::where(truncated, sample_truncated(scaled, top_k, top_p, uniform), sampled);
  }

  // argmax returns the first maximal index, the same lowest-id tie-break as the sort above.
  at::Tensor tokens = at::where(greedy, x.argmax(-1), sampled);                            // [B] int64
  at::Tensor logprobs = at::log_softmax(x, -1).gather(1, tokens.unsqueeze(1)).squeeze(1);  // [B] float32
  return {tokens, logprobs};
}

}  // namespace skyrl_tx::sampling
