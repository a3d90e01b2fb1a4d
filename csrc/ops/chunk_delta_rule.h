// chunk_delta_rule: the chunk-parallel core of the gated delta rule as one autograd Function with a hand-derived
// backward; models::chunk_delta_rule_formula (transformers' torch_chunk_gated_delta_rule, op for op) is its twin.
#pragma once

#include <ATen/ATen.h>

#include <utility>

namespace skyrl_tx::ops {

/// Whether chunk_delta_rule applies: float32 CPU inputs with the fused CPU ops on (cpu_vector_kernels_supported). The
/// op is ATen matmuls and elementwise ops, so it would run on any device; it is verified, and so used, on the CPU only.
bool chunk_delta_rule_applies(const at::Tensor& q);

/// The chunked gated delta rule on prepared chunks, the same arguments and results as chunk_delta_rule_formula:
/// q (l2-normalised and scaled), k (l2-normalised): [B, H, n, C, Dk]; v: [B, H, n, C, Dv]; g (log decay), beta:
/// [B, H, n, C]; initial_state: undefined (zeros) or [B, H, Dk, Dv]. Returns (out [B, H, n, C, Dv], final state
/// [B, H, Dk, Dv]), differentiable in q, k, v, g, beta and the initial state.
///
/// Why: the formula's autograd graph is some forty elementwise nodes over [B, H, n, C, C] and [B, H, n, C, D] per
/// layer, each with a backward that allocates, fills and sums. This saves what the backward needs (the chunk states,
/// the solved values, the decay matrix) and runs a derived backward: the reverse scan over chunks for the state
/// gradient, one transposed triangular solve for both right-hand sides, and the decay's gradient as row-minus-column
/// sums of one [C, C] product. The output's intra-chunk half and every product independent of the scan run once,
/// batched over all chunks, instead of once per chunk.
std::pair<at::Tensor, at::Tensor> chunk_delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                   const at::Tensor& g, const at::Tensor& beta,
                                                   const at::Tensor& initial_state);

}  // namespace skyrl_tx::ops
