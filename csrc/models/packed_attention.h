// Varlen attention over packed sequences: causal within each sequence of a packed row, never across them.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "models/layers.h"

namespace skyrl_tx::models {

/// q: [1, heads, N, Dqk]; k: [1, kv_heads, N, Dqk]; v: [1, kv_heads, N, Dv]; N the packed row's tokens, split into
/// sequences by layout.sequence_starts. Returns [1, heads, N, Dv]: each sequence's causal attention over its own
/// keys only, as if it were a batch of one. CUDA half/bfloat16 (compute capability >= 8.0; a q/k width <= 256 and a
/// multiple of 8, values no wider: MLA's are zero-padded) runs flash attention's varlen kernel over all sequences at
/// once; elsewhere (the CPU, float32) one causal SDPA call per run of equal-length sequences, on views of the row.
/// Both are differentiable.
at::Tensor packed_causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const AttentionMask& layout, double scale);

/// Consecutive packed sequences of one length: `count` sequences of `length` tokens from token `begin`. A run is one
/// batched call ([count, ..., length, ...] views of the row) where a loop over sequences is the kernel (the CPU
/// attention; the Gated DeltaNet conv and delta rule), so many short sequences do not cost a call each.
struct SequenceRun {
  int64_t begin, count, length;
};
/// The runs of layout.sequence_starts, in order (batching packs each adapter's sequences longest first, so equal
/// lengths sit together).
std::vector<SequenceRun> equal_length_runs(const AttentionMask& layout);

/// Whether packed_causal_attention takes the flash varlen kernel for these tensors (a test's and a benchmark's
/// question: the other path is always there).
bool packed_attention_uses_flash(const at::Tensor& q, const at::Tensor& v);

}  // namespace skyrl_tx::models
