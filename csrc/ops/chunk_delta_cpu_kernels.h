// chunk_delta_cpu_kernels: the raw float32 loops of chunk_delta_rule (everything but its GEMMs), one chunk of one
// (batch row, head) per task, compiled for AVX2 + FMA as cpu_vector_kernels.cpp is (its NOTE holds).
#pragma once

#include <cstdint>

namespace skyrl_tx::ops::cpu_kernels {

/// One chunk's sizes. Every tensor is contiguous with one chunk per task: q, k, q_decayed, k_to_end, k_beta [C, Dk];
/// v [C, Dv]; g, beta, cum [C]; the [C, C] matrices; rhs and solved [C, Dv + Dk] (the values' half first).
struct ChunkDims {
  int64_t chunk = 0, key_dim = 0, value_dim = 0;
};

/// Chunks [begin, end): cum = cumsum(g); decay[i, j] = exp(cum_i - cum_j) for j <= i, else 0; k_beta = beta k;
/// rhs = [beta v | exp(cum) beta k]; q_decayed = exp(cum) q; k_to_end = exp(cum_last - cum) k.
void chunk_prepare(const float* q, const float* k, const float* v, const float* g, const float* beta, float* cum,
                   float* decay, float* k_beta, float* rhs, float* q_decayed, float* k_to_end, const ChunkDims& dims,
                   int64_t begin, int64_t end);

/// Chunks [begin, end): ut (k_beta k^T in) becomes its decayed strictly lower part (0 elsewhere), intra (q k^T in)
/// becomes intra * decay, and inverse = (I + ut)^-1, unit lower triangular, by forward substitution.
void chunk_mask_and_invert(float* ut, float* intra, const float* decay, float* inverse, const ChunkDims& dims,
                           int64_t begin, int64_t end);

/// Chunks [begin, end): with grad_ut = -(strictly lower part of the product in `grad_ut`) and grad_intra in, writes
/// grad_cum = row sums minus column sums of (grad_ut * ut + grad_intra * intra), then grad_ut *= decay and
/// grad_intra *= decay (the gradients at k_beta k^T and q k^T).
void chunk_decay_grads(float* grad_ut, float* grad_intra, const float* ut, const float* intra, const float* decay,
                       float* grad_cum, const ChunkDims& dims, int64_t begin, int64_t end);

/// What chunk_input_grads reads, each laid out as ChunkDims says; the gemm_* are the matmul terms: gemm_k_beta =
/// grad_kk k, gemm_k = grad_kk^T k_beta + grad_qk^T q, gemm_q = grad_qk k. chunk_decay_grad: one per chunk.
struct ChunkGradInputs {
  const float *q, *k, *v, *beta, *cum, *k_beta, *q_decayed, *k_to_end;
  const float *grad_rhs, *grad_q_decayed, *grad_k_to_end, *gemm_k_beta, *gemm_k, *gemm_q, *chunk_decay_grad;
};
/// Chunks [begin, end): the gradients at q, k, v, beta and g (grad_cum in: the decay matrix's part, from
/// chunk_decay_grads; it gains the exp(cum) factors' parts, then g's is its reverse cumulative sum).
void chunk_input_grads(const ChunkGradInputs& in, float* grad_cum, float* grad_q, float* grad_k, float* grad_v,
                       float* grad_g, float* grad_beta, const ChunkDims& dims, int64_t begin, int64_t end);

}  // namespace skyrl_tx::ops::cpu_kernels
