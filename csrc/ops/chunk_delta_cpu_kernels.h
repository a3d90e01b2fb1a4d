// chunk_delta_cpu_kernels: the raw float32 loops of chunk_gated_delta_rule_cpu (everything but its GEMMs), one chunk
// of one (batch row, head) per task, compiled for AVX2 + FMA as cpu_vector_kernels.cpp is (its NOTE holds).
#pragma once

#include <cstdint>

namespace skyrl_tx::ops::cpu_kernels {

/// One chunk's sizes and where it sits. Every chunk-layout tensor is contiguous [B, heads, n, C, ...], one chunk per
/// task (task = (b * heads + h) * n + chunk): q, k, q_decayed, k_to_end, k_beta [C, Dk]; v [C, Dv]; g, beta, cum and
/// the inverse norms [C]; the [C, C] matrices; rhs and solved [C, Dv + Dk] (the values' half first).
struct ChunkDims {
  int64_t chunk = 0, key_dim = 0, value_dim = 0;
  int64_t heads = 0, chunks = 0, tokens = 0, heads_per_key = 1;  // value heads, chunks per sequence, real tokens
  float q_scale = 1.0f;                                           // 1 / sqrt(key_dim)
};

/// The rule's raw inputs as the model passes them (element strides batch, token, head; last dims unit-stride):
/// q, k [B, T, key_heads, Dk], v [B, T, heads, Dv], g and beta [B, T, heads]. Value head h reads key head
/// h / heads_per_key.
struct ChunkRawInputs {
  const float *q, *k, *v, *g, *beta;
  int64_t q_stride[3], k_stride[3], v_stride[3], g_stride[3], beta_stride[3];
};

/// What chunk_prepare writes, all in chunk layout.
struct ChunkPrepared {
  float *q, *k, *v, *beta, *inv_norm_q, *inv_norm_k;  // q = l2norm(q) * q_scale, k = l2norm(k); zeros past T
  float *cum, *decay, *k_beta, *rhs, *q_decayed, *k_to_end;
};

/// Chunks [begin, end): gathers the raw inputs into chunk layout (positions past T: zeros, g = beta = 0), with
/// l2norm(x) = x / sqrt(sum x^2 + 1e-6) on q and k; then cum = cumsum(g); decay[i, j] = exp(cum_i - cum_j) for j <= i,
/// else 0; k_beta = beta k; rhs = [beta v | exp(cum) k_beta]; q_decayed = exp(cum) q; k_to_end = exp(cum_last - cum) k.
void chunk_prepare(const ChunkRawInputs& in, const ChunkPrepared& out, const ChunkDims& dims, int64_t begin,
                   int64_t end);

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
/// Chunks [begin, end): the gradients at the chunk-layout q, k, v, beta and g (grad_cum in: the decay matrix's part,
/// from chunk_decay_grads; it gains the exp(cum) factors' parts, then g's is its reverse cumulative sum).
void chunk_input_grads(const ChunkGradInputs& in, float* grad_cum, float* grad_q, float* grad_k, float* grad_v,
                       float* grad_g, float* grad_beta, const ChunkDims& dims, int64_t begin, int64_t end);

/// Tasks [begin, end) of B * T, task (b, t): the chunk-layout gradients back to the raw inputs' layout, contiguous
/// [B, T, key_heads, Dk] for q and k (each key head sums its value heads', then through the l2 norm: grad_x =
/// (grad_y - y (y . grad_y)) / norm), [B, T, heads, Dv] for v and [B, T, heads] for g and beta. q, k and the inverse
/// norms are chunk_prepare's.
struct ChunkScatter {
  const float *q, *k, *inv_norm_q, *inv_norm_k, *grad_q, *grad_k, *grad_v, *grad_g, *grad_beta;
};
void chunk_scatter_grads(const ChunkScatter& in, float* grad_q, float* grad_k, float* grad_v, float* grad_g,
                         float* grad_beta, const ChunkDims& dims, int64_t begin, int64_t end);

}  // namespace skyrl_tx::ops::cpu_kernels
