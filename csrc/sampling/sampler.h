// Token choice for a batch of rows, each with its own temperature, top-k, top-p and random draw.
#pragma once

#include <ATen/ATen.h>

namespace skyrl_tx::sampling {

struct RowSamplingParams {
  at::Tensor temperature;  // [B] float32; 0 = greedy (argmax)
  at::Tensor top_k;        // [B] int64; <= 0 = no top-k
  at::Tensor top_p;        // [B] float32 in (0, 1]; 1 = no nucleus cut
  at::Tensor uniform;      // [B] float32 in [0, 1): the row's random draw (from its own seeded generator)
  // Host-side hint: true when the caller knows no row uses top-k or top-p, so the vocabulary sort is skipped.
  // NOTE: it never changes a result (such rows never use the sort); it only saves work.
  bool all_untruncated = false;
};

struct SampledTokens {
  at::Tensor tokens;    // [B] int64
  at::Tensor logprobs;  // [B] float32: log_softmax(logits)[token], the unmodified model distribution
};

/// logits: [B, V] (any float dtype; computed in float32). All tensors on the logits' device; no host
/// synchronisation. Sampling is by inverse CDF walked in token-id order over the kept tokens (rows with
/// top-k or top-p find those by a descending sort; other rows keep every token of nonzero probability), so
/// a row's token depends only on its own logits, parameters and uniform draw (batch-independent).
/// Greedy ties resolve to the lowest token id, like torch.argmax.
SampledTokens sample_tokens(const at::Tensor& logits, const RowSamplingParams& params);

}  // namespace skyrl_tx::sampling
