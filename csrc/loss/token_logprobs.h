// Target-token log-probabilities from hidden states, chunked so [tokens, vocab] logits never exist at once, and
// vocabulary-parallel under tensor parallelism so no rank ever holds [tokens, full vocab] either.
#pragma once

#include <ATen/ATen.h>

#include "dist/tensor_parallel.h"
#include "lora/adapter_segments.h"
#include "lora/lora_linear.h"

namespace skyrl_tx::loss {

/// What a logprob is read through: the lm_head (LoRA-capable), holding vocabulary rows `vocab` of the full
/// vocabulary (all of them without tensor parallelism), and the group the other rows live on.
struct OutputHead {
  OutputHead(const lora::LoraLinear& head, const dist::TensorParallel& tp, dist::Shard rows)
      : lm_head(head), tensor_parallel(tp), vocab(rows) {}
  /// One process's head: every vocabulary row.
  OutputHead(const lora::LoraLinear& head)  // NOLINT(google-explicit-constructor): a whole head is a head
      : lm_head(head), tensor_parallel(dist::kNoTensorParallel), vocab{0, head.out_features()} {}

  const lora::LoraLinear& lm_head;
  const dist::TensorParallel& tensor_parallel;
  dist::Shard vocab;
};

/// One chunk, no chunking: hidden [n, hidden], targets int64 [n] → float32 [n] (keeps autograd). Sharded: the
/// log-softmax's max, sum of exponentials and target logit are each combined over the group (Megatron-LM's
/// vocabulary-parallel cross entropy), and the hidden states' gradient is summed over it.
at::Tensor target_logprobs(const OutputHead& head, const at::Tensor& hidden, const at::Tensor& targets,
                           const lora::AdapterSegments& segments);

/// hidden: [N, hidden]; targets: int64 [N] → float32 [N] with log p(target | prefix).
/// Logits are produced `chunk_tokens` rows at a time through the head (LoRA per segment) and upcast
/// to float32 before the log-softmax, so only [chunk_tokens, vocab] is live.
at::Tensor token_logprobs(const OutputHead& head, const at::Tensor& hidden, const at::Tensor& targets,
                          const lora::AdapterSegments& segments, int64_t chunk_tokens);

}  // namespace skyrl_tx::loss
