// chunk_delta_cpu_kernels: the raw float32 loops of chunk_delta_rule (everything but its GEMMs), one chunk of one
// (batch row, head) per task, compiled for AVX2 + FMA as cpu_vector_kernels.cpp is (its NOTE holds: nothing here runs
// before cpu_vector_kernels_supported() said yes, and no standard-library template is instantiated here). The inner
// loops are plain unit-stride loops the compiler vectorises.
#include "ops/chunk_delta_cpu_kernels.h"

#include <cmath>

namespace skyrl_tx::ops::cpu_kernels {

void chunk_prepare(const float* q, const float* k, const float* v, const float* g, const float* beta, float* cum,
                   float* decay, float* k_beta, float* rhs, float* q_decayed, float* k_to_end, const ChunkDims& dims,
                   int64_t begin, int64_t end) {
  const int64_t C = dims.chunk, Dk = dims.key_dim, Dv = dims.value_dim, W = Dv + Dk;
  for (int64_t t = begin; t < end; ++t) {
    float* cu = cum + t * C;
    double running = 0.0;  // as ATen's CPU cumsum accumulates float
    for (int64_t i = 0; i < C; ++i) cu[i] = static_cast<float>(running += g[t * C + i]);
    float* dc = decay + t * C * C;
    for (int64_t i = 0; i < C; ++i) {
      for (int64_t j = 0; j <= i; ++j) dc[i * C + j] = std::exp(cu[i] - cu[j]);
      for (int64_t j = i + 1; j < C; ++j) dc[i * C + j] = 0.0f;
    }
    const float last = cu[C - 1];
    for (int64_t i = 0; i < C; ++i) {
      const int64_t row = t * C + i;
      const float from_start = std::exp(cu[i]), to_end = std::exp(last - cu[i]), b = beta[row];
      const float *qr = q + row * Dk, *kr = k + row * Dk, *vr = v + row * Dv;
      float *kb = k_beta + row * Dk, *qd = q_decayed + row * Dk, *kt = k_to_end + row * Dk, *rr = rhs + row * W;
      for (int64_t d = 0; d < Dv; ++d) rr[d] = vr[d] * b;
      for (int64_t d = 0; d < Dk; ++d) {
        kb[d] = kr[d] * b;
        rr[Dv + d] = kb[d] * from_start;
        qd[d] = qr[d] * from_start;
        kt[d] = kr[d] * to_end;
      }
    }
  }
}

void chunk_mask_and_invert(float* ut, float* intra, const float* decay, float* inverse, const ChunkDims& dims,
                           int64_t begin, int64_t end) {
  const int64_t C = dims.chunk;
  for (int64_t t = begin; t < end; ++t) {
    float *u = ut + t * C * C, *in = intra + t * C * C, *inv = inverse + t * C * C;
    const float* dc = decay + t * C * C;
    for (int64_t i = 0; i < C; ++i) {
      for (int64_t j = 0; j < i; ++j) u[i * C + j] *= dc[i * C + j];
      for (int64_t j = i; j < C; ++j) u[i * C + j] = 0.0f;
      for (int64_t j = 0; j < C; ++j) in[i * C + j] *= dc[i * C + j];
    }
    // (I + A) T = I with A strictly lower: row i of T is e_i - sum over c < i of A[i, c] (row c of T), and row c is
    // zero right of c.
    for (int64_t i = 0; i < C; ++i) {
      float* row = inv + i * C;
      for (int64_t j = 0; j < C; ++j) row[j] = 0.0f;
      row[i] = 1.0f;
      for (int64_t c = 0; c < i; ++c) {
        const float a = u[i * C + c];
        const float* earlier = inv + c * C;
        for (int64_t j = 0; j <= c; ++j) row[j] -= a * earlier[j];
      }
    }
  }
}

void chunk_decay_grads(float* grad_ut, float* grad_intra, const float* ut, const float* intra, const float* decay,
                       float* grad_cum, const ChunkDims& dims, int64_t begin, int64_t end) {
  const int64_t C = dims.chunk;
  for (int64_t t = begin; t < end; ++t) {
    float *gu = grad_ut + t * C * C, *gi = grad_intra + t * C * C, *gc = grad_cum + t * C;
    const float *u = ut + t * C * C, *in = intra + t * C * C, *dc = decay + t * C * C;
    for (int64_t i = 0; i < C; ++i) gc[i] = 0.0f;
    for (int64_t i = 0; i < C; ++i) {
      float row_sum = 0.0f;
      for (int64_t j = 0; j < C; ++j) {
        const int64_t idx = i * C + j;
        const float g_ut = j < i ? -gu[idx] : 0.0f;
        // decay[i, j] = exp(cum_i - cum_j): its gradient times itself goes to cum_i and is taken from cum_j
        const float through = g_ut * u[idx] + gi[idx] * in[idx];
        row_sum += through;
        gc[j] -= through;
        gu[idx] = g_ut * dc[idx];
        gi[idx] *= dc[idx];
      }
      gc[i] += row_sum;
    }
  }
}

void chunk_input_grads(const ChunkGradInputs& in, float* grad_cum, float* grad_q, float* grad_k, float* grad_v,
                       float* grad_g, float* grad_beta, const ChunkDims& dims, int64_t begin, int64_t end) {
  const int64_t C = dims.chunk, Dk = dims.key_dim, Dv = dims.value_dim, W = Dv + Dk;
  for (int64_t t = begin; t < end; ++t) {
    const float* cu = in.cum + t * C;
    float* gc = grad_cum + t * C;
    const float last = cu[C - 1];
    float to_end_total = 0.0f;
    for (int64_t i = 0; i < C; ++i) {
      const int64_t row = t * C + i;
      const float from_start = std::exp(cu[i]), to_end = std::exp(last - cu[i]), b = in.beta[row];
      const float* g_rhs = in.grad_rhs + row * W;  // [beta v | exp(cum) k_beta]'s gradients
      float through_q = 0.0f, through_rhs = 0.0f, through_to_end = 0.0f, to_beta = 0.0f;
      for (int64_t d = 0; d < Dk; ++d) {
        const int64_t idx = row * Dk + d;
        const float g_x = g_rhs[Dv + d];
        const float g_k_beta = in.gemm_k_beta[idx] + g_x * from_start;
        grad_k[idx] = in.gemm_k[idx] + in.grad_k_to_end[idx] * to_end + g_k_beta * b;
        grad_q[idx] = in.gemm_q[idx] + in.grad_q_decayed[idx] * from_start;
        through_q += in.grad_q_decayed[idx] * in.q_decayed[idx];
        through_rhs += g_x * in.k_beta[idx];
        through_to_end += in.grad_k_to_end[idx] * in.k_to_end[idx];
        to_beta += g_k_beta * in.k[idx];
      }
      for (int64_t d = 0; d < Dv; ++d) {
        grad_v[row * Dv + d] = g_rhs[d] * b;
        to_beta += g_rhs[d] * in.v[row * Dv + d];
      }
      grad_beta[row] = to_beta;
      gc[i] += through_q + through_rhs * from_start - through_to_end;  // each exp(±cum_i) factor's share
      to_end_total += through_to_end;
    }
    gc[C - 1] += to_end_total + in.chunk_decay_grad[t] * std::exp(last);  // exp(cum_last - cum) and the chunk decay
    float running = 0.0f;  // cum = cumsum(g): g_i's gradient is the sum of cum's from i on
    for (int64_t i = C - 1; i >= 0; --i) grad_g[t * C + i] = running += gc[i];
  }
}

}  // namespace skyrl_tx::ops::cpu_kernels
