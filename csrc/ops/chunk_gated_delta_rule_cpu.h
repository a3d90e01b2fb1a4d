// chunk_gated_delta_rule_cpu: the chunked gated delta rule (prefill and training) on float32 CPU tensors as one
// autograd Function with a hand-derived backward; models::chunk_gated_delta_rule_formula is its twin and oracle.
#pragma once

#include <ATen/ATen.h>

#include <utility>

namespace skyrl_tx::ops {

/// Whether chunk_gated_delta_rule_cpu applies: float32 CPU q, k [B, T, key_heads, Dk], v [B, T, heads, Dv], g and
/// beta [B, T, heads] with unit-stride last dims (any other strides: a packed run's views), with the fused CPU ops on
/// (cpu_vector_kernels_supported).
bool chunk_gated_delta_rule_cpu_applies(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                        const at::Tensor& g, const at::Tensor& beta);

/// The chunk_gated_delta_rule_formula it replaces, same arguments and results: out [B, T, heads, Dv] float32 and the
/// final state [B, heads, Dk, Dv]; differentiable in q, k, v, g, beta and the initial state.
///
/// Why: the formula's autograd graph is some sixty ATen nodes per layer (the l2 norms, the head repeat, the padding,
/// the decays, the masks, the solves), each with a backward that allocates, fills and sums. This gathers the raw
/// inputs into chunks in one pass (norms, repeat and padding included), keeps every GEMM a batched aten::bmm over all
/// chunks (the UT transform as (I + ut)^-1 times both right-hand sides; only the scan over chunks is sequential), does
/// the elementwise work in loops over one chunk per task (ops/chunk_delta_cpu_kernels.cpp), and runs a derived
/// backward: the reverse scan for the state gradient, the decay matrix's gradient as row-minus-column sums, and the
/// gradients scattered back through the norms and the head repeat.
std::pair<at::Tensor, at::Tensor> chunk_gated_delta_rule_cpu(const at::Tensor& q, const at::Tensor& k,
                                                             const at::Tensor& v, const at::Tensor& g,
                                                             const at::Tensor& beta, int64_t chunk_size,
                                                             const at::Tensor& initial_state);

}  // namespace skyrl_tx::ops
