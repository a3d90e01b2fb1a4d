// chunk_delta_cpu_kernels: the raw float32 loops of chunk_gated_delta_rule_cpu (everything but its GEMMs), one chunk
// of one (batch row, head) per task, compiled for AVX2 + FMA as cpu_vector_kernels.cpp is (its NOTE holds: nothing
// here runs before cpu_vector_kernels_supported() said yes, and no standard-library template is instantiated here).
// The exps, dot products and the decay gradient's sums use ATen's vectors; the other inner loops are plain unit-stride
// loops the compiler vectorises.
#include "ops/chunk_delta_cpu_kernels.h"

#include <cmath>

#include "ops/cpu_vector_math.h"

namespace skyrl_tx::ops::cpu_kernels {
namespace {

// exp(start - x[j]) for j in [0, n): a row of the decay matrix, eight lanes per ATen vector exp (C^2 of them per chunk,
// the scalar std::exp's cost was most of this file's).
void exp_of_difference(float start, const float* x, float* out, int64_t n) {
  const Vec from(start);
  for (int64_t j = 0; j < n; j += Vec::size()) {
    (from - Vec::loadu(x + j, lanes(n - j))).exp_u20().store(out + j, lanes(n - j));
  }
}

float sum_of(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](const Vec& x, const Vec& y) { return x + y; }, v);
}

}  // namespace

void chunk_prepare(const ChunkRawInputs& in, const ChunkPrepared& out, const ChunkDims& dims, int64_t begin,
                   int64_t end) {
  const int64_t C = dims.chunk, Dk = dims.key_dim, Dv = dims.value_dim, W = Dv + Dk;
  for (int64_t t = begin; t < end; ++t) {
    const int64_t chunk = t % dims.chunks, bh = t / dims.chunks, h = bh % dims.heads, b = bh / dims.heads;
    const int64_t key_head = h / dims.heads_per_key;
    float* cu = out.cum + t * C;  // g first, then its running sum
    for (int64_t i = 0; i < C; ++i) {
      const int64_t row = t * C + i, token = chunk * C + i;
      float *q = out.q + row * Dk, *k = out.k + row * Dk, *v = out.v + row * Dv;
      if (token >= dims.tokens) {  // padding to a whole chunk: nothing decays, nothing is written
        for (int64_t d = 0; d < Dk; ++d) q[d] = k[d] = 0.0f;
        for (int64_t d = 0; d < Dv; ++d) v[d] = 0.0f;
        cu[i] = out.beta[row] = out.inv_norm_q[row] = out.inv_norm_k[row] = 0.0f;
        continue;
      }
      const float* q_in = in.q + b * in.q_stride[0] + token * in.q_stride[1] + key_head * in.q_stride[2];
      const float* k_in = in.k + b * in.k_stride[0] + token * in.k_stride[1] + key_head * in.k_stride[2];
      const float* v_in = in.v + b * in.v_stride[0] + token * in.v_stride[1] + h * in.v_stride[2];
      const float inv_q = 1.0f / std::sqrt(dot(q_in, q_in, Dk) + 1e-6f);
      const float inv_k = 1.0f / std::sqrt(dot(k_in, k_in, Dk) + 1e-6f);
      for (int64_t d = 0; d < Dk; ++d) {
        q[d] = q_in[d] * inv_q * dims.q_scale;
        k[d] = k_in[d] * inv_k;
      }
      for (int64_t d = 0; d < Dv; ++d) v[d] = v_in[d];
      cu[i] = in.g[b * in.g_stride[0] + token * in.g_stride[1] + h * in.g_stride[2]];
      out.beta[row] = in.beta[b * in.beta_stride[0] + token * in.beta_stride[1] + h * in.beta_stride[2]];
      out.inv_norm_q[row] = inv_q;
      out.inv_norm_k[row] = inv_k;
    }
    double running = 0.0;  // as ATen's CPU cumsum accumulates float
    for (int64_t i = 0; i < C; ++i) cu[i] = static_cast<float>(running += cu[i]);
    float* dc = out.decay + t * C * C;
    for (int64_t i = 0; i < C; ++i) {
      exp_of_difference(cu[i], cu, dc + i * C, i + 1);
      for (int64_t j = i + 1; j < C; ++j) dc[i * C + j] = 0.0f;
    }
    const float last = cu[C - 1];
    for (int64_t i = 0; i < C; ++i) {
      const int64_t row = t * C + i;
      const float from_start = std::exp(cu[i]), to_end = std::exp(last - cu[i]), beta = out.beta[row];
      const float *q = out.q + row * Dk, *k = out.k + row * Dk, *v = out.v + row * Dv;
      float *kb = out.k_beta + row * Dk, *qd = out.q_decayed + row * Dk, *kt = out.k_to_end + row * Dk;
      float* rr = out.rhs + row * W;
      for (int64_t d = 0; d < Dv; ++d) rr[d] = v[d] * beta;
      for (int64_t d = 0; d < Dk; ++d) {
        kb[d] = k[d] * beta;
        rr[Dv + d] = kb[d] * from_start;
        qd[d] = q[d] * from_start;
        kt[d] = k[d] * to_end;
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
    // decay[i, j] = exp(cum_i - cum_j): its gradient times itself (`through`) goes to cum_i and is taken from cum_j.
    // Below the diagonal both products count; on it only intra's; above it everything is zero.
    for (int64_t i = 0; i < C; ++i) {
      float *gu_row = gu + i * C, *gi_row = gi + i * C;
      const float *u_row = u + i * C, *in_row = in + i * C, *dc_row = dc + i * C;
      Vec row_sum(0.0f);
      for (int64_t j = 0; j < i; j += Vec::size()) {
        const int64_t n = lanes(i - j);
        const Vec g_ut = Vec(0.0f) - Vec::loadu(gu_row + j, n), g_in = Vec::loadu(gi_row + j, n);
        const Vec decay_ij = Vec::loadu(dc_row + j, n);
        const Vec through = g_ut * Vec::loadu(u_row + j, n) + g_in * Vec::loadu(in_row + j, n);
        row_sum = row_sum + through;
        (Vec::loadu(gc + j, n) - through).store(gc + j, n);
        (g_ut * decay_ij).store(gu_row + j, n);
        (g_in * decay_ij).store(gi_row + j, n);
      }
      // The diagonal's share goes to cum_i and is taken from it: none. decay[i, i] = 1.
      gu_row[i] = 0.0f;
      for (int64_t j = i + 1; j < C; ++j) gu_row[j] = gi_row[j] = 0.0f;
      gc[i] += sum_of(row_sum);
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
      const float *g_x = g_rhs + Dv, *k_row = in.k + row * Dk, *g_to_end = in.grad_k_to_end + row * Dk;
      const float through_q = dot(in.grad_q_decayed + row * Dk, in.q_decayed + row * Dk, Dk);
      const float through_rhs = dot(g_x, in.k_beta + row * Dk, Dk);
      const float through_to_end = dot(g_to_end, in.k_to_end + row * Dk, Dk);
      // k_beta's gradient is gemm_k_beta + exp(cum) g_x, and beta's is its product with k plus g_v's with v
      const float to_beta = dot(in.gemm_k_beta + row * Dk, k_row, Dk) + from_start * dot(g_x, k_row, Dk) +
                            dot(g_rhs, in.v + row * Dv, Dv);
      for (int64_t d = 0; d < Dk; ++d) {
        const int64_t idx = row * Dk + d;
        const float g_k_beta = in.gemm_k_beta[idx] + g_x[d] * from_start;
        grad_k[idx] = in.gemm_k[idx] + g_to_end[d] * to_end + g_k_beta * b;
        grad_q[idx] = in.gemm_q[idx] + in.grad_q_decayed[idx] * from_start;
      }
      for (int64_t d = 0; d < Dv; ++d) grad_v[row * Dv + d] = g_rhs[d] * b;
      grad_beta[row] = to_beta;
      gc[i] += through_q + through_rhs * from_start - through_to_end;  // each exp(±cum_i) factor's share
      to_end_total += through_to_end;
    }
    gc[C - 1] += to_end_total + in.chunk_decay_grad[t] * std::exp(last);  // exp(cum_last - cum) and the chunk decay
    float running = 0.0f;  // cum = cumsum(g): g_i's gradient is the sum of cum's from i on
    for (int64_t i = C - 1; i >= 0; --i) grad_g[t * C + i] = running += gc[i];
  }
}

void chunk_scatter_grads(const ChunkScatter& in, float* grad_q, float* grad_k, float* grad_v, float* grad_g,
                         float* grad_beta, const ChunkDims& dims, int64_t begin, int64_t end) {
  const int64_t C = dims.chunk, Dk = dims.key_dim, Dv = dims.value_dim, heads = dims.heads;
  const int64_t per_key = dims.heads_per_key, key_heads = heads / per_key;
  const float scale = dims.q_scale;
  for (int64_t task = begin; task < end; ++task) {
    const int64_t b = task / dims.tokens, token = task % dims.tokens, chunk = token / C, i = token % C;
    const auto row_of = [&](int64_t h) { return ((b * heads + h) * dims.chunks + chunk) * C + i; };
    for (int64_t key_head = 0; key_head < key_heads; ++key_head) {
      float *gq = grad_q + (task * key_heads + key_head) * Dk, *gk = grad_k + (task * key_heads + key_head) * Dk;
      for (int64_t d = 0; d < Dk; ++d) gq[d] = gk[d] = 0.0f;
      for (int64_t r = 0; r < per_key; ++r) {  // the value heads that read this key head
        const int64_t row = row_of(key_head * per_key + r);
        for (int64_t d = 0; d < Dk; ++d) {
          gq[d] += in.grad_q[row * Dk + d];
          gk[d] += in.grad_k[row * Dk + d];
        }
      }
      // Through the l2 norm (y = x / norm, so grad_x = (grad_y - y (y . grad_y)) / norm); q also had the scale s:
      // q = s y, so grad_y = s grad_q and y . grad_y = q . grad_q.
      const int64_t row = row_of(key_head * per_key);
      const float *q = in.q + row * Dk, *k = in.k + row * Dk;
      const float q_along = dot(q, gq, Dk) / scale, k_along = dot(k, gk, Dk);
      const float inv_q = in.inv_norm_q[row], inv_k = in.inv_norm_k[row];
      for (int64_t d = 0; d < Dk; ++d) {
        gq[d] = inv_q * (scale * gq[d] - q[d] * q_along);
        gk[d] = inv_k * (gk[d] - k[d] * k_along);
      }
    }
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t row = row_of(h), out = task * heads + h;
      for (int64_t d = 0; d < Dv; ++d) grad_v[out * Dv + d] = in.grad_v[row * Dv + d];
      grad_g[out] = in.grad_g[row];
      grad_beta[out] = in.grad_beta[row];
    }
  }
}

}  // namespace skyrl_tx::ops::cpu_kernels
