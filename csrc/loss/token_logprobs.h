// Target-token log-probabilities from hidden states, chunked so [tokens, vocab] logits never exist at once.
#pragma once

#include <ATen/ATen.h>

#include "lora/adapter_segments.h"
#include "lora/lora_linear.h"

namespace skyrl_tx::loss {

/// One chunk, no chunking: hidden [n, hidden], targets int64 [n] → float32 [n] (keeps autograd).
at::Tensor target_logprobs(const lora::LoraLinear& lm_head, const at::Tensor& hidden, const at::Tensor& targets,
                           const lora::AdapterSegments& segments);

/// hidden: [N, hidden]; targets: int64 [N] → float32 [N] with log p(target | prefix).
/// Logits are produced `chunk_tokens` rows at a time through `lm_head` (LoRA per segment) and upcast
/// to float32 before the log-softmax, so only [chunk_tokens, vocab] is live.
at::Tensor token_logprobs(const lora::LoraLinear& lm_head, const at::Tensor& hidden, const at::Tensor& targets,
                          const lora::AdapterSegments& segments, int64_t chunk_tokens);

}  // namespace skyrl_tx::loss
