// Raw float32 loops of Gated DeltaNet's fused CPU ops (gated_delta_step_cpu, conv_silu_cpu), compiled for AVX2 + FMA
// on x86-64 as cpu_vector_kernels.cpp is (its NOTE holds here: nothing runs before cpu_vector_kernels_supported()
// said yes, and no standard-library template is instantiated here).
#include <cmath>

#include "ops/cpu_vector_kernels.h"
#include "ops/cpu_vector_math.h"

namespace skyrl_tx::ops::cpu_kernels {

namespace {

// One (row, value head)'s tensors in gated_delta_step.
struct HeadColumns {
  float* s;  // the state [key_dim, value_dim]
  const float *v, *q_hat, *k_hat;
  float* out;
  int64_t key_dim, value_dim;
  Vec decay, gain;
};

constexpr int kDeltaBlock = 4;  // column vectors per pass: independent add chains instead of one latency-bound one

// Columns [j, j + W vectors) of one head, the last vector `n` lanes wide: S^T k̂ over the key rows (each column's sum
// in key order), then the rank-1 write and state^T q̂ over them again.
template <int W>
void delta_columns(const HeadColumns& h, int64_t j, int64_t n) {
  const auto width = [n](int c) { return c == W - 1 ? n : Vec::size(); };
  Vec recalled[W];  // (S^T k̂)[j..]: what the state holds for this key
  for (int c = 0; c < W; ++c) recalled[c] = Vec(0.0f);
  for (int64_t i = 0; i < h.key_dim; ++i) {
    const Vec k(h.k_hat[i]);
    const float* row = h.s + i * h.value_dim + j;
    for (int c = 0; c < W; ++c) recalled[c] = recalled[c] + Vec::loadu(row + c * Vec::size(), width(c)) * h.decay * k;
  }
  Vec delta[W], read[W];
  for (int c = 0; c < W; ++c) {
    delta[c] = (Vec::loadu(h.v + j + c * Vec::size(), width(c)) - recalled[c]) * h.gain;
    read[c] = Vec(0.0f);
  }
  for (int64_t i = 0; i < h.key_dim; ++i) {
    const Vec k(h.k_hat[i]), q(h.q_hat[i]);
    float* row = h.s + i * h.value_dim + j;
    for (int c = 0; c < W; ++c) {
      const Vec updated = Vec::loadu(row + c * Vec::size(), width(c)) * h.decay + k * delta[c];
      updated.store(row + c * Vec::size(), width(c));
      read[c] = at::vec::fmadd(updated, q, read[c]);
    }
  }
  for (int c = 0; c < W; ++c) read[c].store(h.out + j + c * Vec::size(), width(c));
}

}  // namespace

// Per (row, value head), column block by column block (four vectors of value columns, then one at a time, a partial
// one at a ragged tail): S^T k̂ over the key rows, then the rank-1 write and state^T q̂ over them again (the head's
// matrix is in L1 by then).
// Each product and sum rounds as the formula's (S = state * decay first; S + k̂ * delta, -ffp-contract=off); only
// the sums over key rows run in another order than ATen's reduction. A row's result depends on its own tensors only.
void gated_delta_step(const float* q, const float* k, const float* v, const float* g, const float* beta, float* state,
                      float* out, float* scratch, const GatedDeltaRows& rows, int64_t begin, int64_t end) {
  const int64_t key_dim = rows.key_dim, value_dim = rows.value_dim;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(key_dim)));
  float *q_hat = scratch, *k_hat = scratch + key_dim;
  for (int64_t task = begin; task < end; ++task) {
    const int64_t b = task / rows.heads, h = task % rows.heads, key_head = h / rows.heads_per_key;
    const float* q_in = q + b * rows.q_stride[0] + key_head * rows.q_stride[1];
    const float* k_in = k + b * rows.k_stride[0] + key_head * rows.k_stride[1];
    const float q_norm = 1.0f / std::sqrt(dot(q_in, q_in, key_dim) + 1e-6f);
    const float k_norm = 1.0f / std::sqrt(dot(k_in, k_in, key_dim) + 1e-6f);
    for (int64_t i = 0; i < key_dim; ++i) {
      q_hat[i] = (q_in[i] * q_norm) * scale;
      k_hat[i] = k_in[i] * k_norm;
    }
    const Vec decay(std::exp(g[b * rows.g_stride[0] + h * rows.g_stride[1]]));
    const Vec gain(beta[b * rows.beta_stride[0] + h * rows.beta_stride[1]]);
    const float* v_in = v + b * rows.v_stride[0] + h * rows.v_stride[1];
    float* s = state + b * rows.state_stride[0] + h * rows.state_stride[1];  // [key_dim, value_dim]
    float* o = out + b * rows.out_stride[0] + h * rows.out_stride[1];
    const HeadColumns head{s, v_in, q_hat, k_hat, o, key_dim, value_dim, decay, gain};
    int64_t j = 0;
    for (; j + kDeltaBlock * Vec::size() <= value_dim; j += kDeltaBlock * Vec::size()) {
      delta_columns<kDeltaBlock>(head, j, Vec::size());
    }
    for (; j < value_dim; j += Vec::size()) delta_columns<1>(head, j, lanes(value_dim - j));
  }
}

namespace {

// The conv's pre-activation at token row `row` (of B * T), channels [c, c + n): the window's products added oldest
// first, each rounded (the decode step's conv_step_cpu adds the same products in the same order).
Vec conv_pre(const float* x, const float* w, const CausalConvRows& rows, int64_t row, int64_t c, int64_t n) {
  const int64_t b = row / rows.tokens, t = row % rows.tokens;
  Vec pre(0.0f);
  for (int64_t k = 0; k < rows.kernel; ++k) {
    const int64_t source = t - (rows.kernel - 1) + k;
    if (source < 0) continue;
    pre = pre + Vec::loadu(x + b * rows.x_stride[0] + source * rows.x_stride[1] + c, n) *
                    Vec::loadu(w + k * rows.channels + c, n);
  }
  return pre;
}

}  // namespace

void conv_silu_forward(const float* x, const float* w, float* out, const CausalConvRows& rows, int64_t begin,
                       int64_t end) {
  const Vec one(1.0f);
  for (int64_t row = begin; row < end; ++row) {
    for (int64_t c = 0; c < rows.channels; c += Vec::size()) {
      const int64_t n = lanes(rows.channels - c);
      const Vec pre = conv_pre(x, w, rows, row, c, n);
      (pre / (one + pre.neg().exp_u20())).store(out + row * rows.channels + c, n);
    }
  }
}

void conv_silu_grad_pre(const float* grad, const float* x, const float* w, float* grad_pre, const CausalConvRows& rows,
                        int64_t begin, int64_t end) {
  const Vec one(1.0f);
  for (int64_t row = begin; row < end; ++row) {
    for (int64_t c = 0; c < rows.channels; c += Vec::size()) {
      const int64_t n = lanes(rows.channels - c);
      const Vec pre = conv_pre(x, w, rows, row, c, n);
      const Vec sig = one / (one + pre.neg().exp_u20());
      const int64_t at = row * rows.channels + c;
      (Vec::loadu(grad + at, n) * sig * (one + pre * (one - sig))).store(grad_pre + at, n);
    }
  }
}

void conv_grad_input(const float* grad_pre, const float* w, float* grad_x, const CausalConvRows& rows, int64_t begin,
                     int64_t end) {
  for (int64_t row = begin; row < end; ++row) {
    const int64_t t = row % rows.tokens;
    for (int64_t c = 0; c < rows.channels; c += Vec::size()) {
      const int64_t n = lanes(rows.channels - c);
      Vec sum(0.0f);
      for (int64_t k = rows.kernel - 1; k >= 0; --k) {  // the tokens this one feeds, nearest first
        const int64_t target = t + (rows.kernel - 1) - k;
        if (target >= rows.tokens) continue;
        sum = sum + Vec::loadu(grad_pre + (row - t + target) * rows.channels + c, n) *
                        Vec::loadu(w + k * rows.channels + c, n);
      }
      sum.store(grad_x + row * rows.channels + c, n);
    }
  }
}

}  // namespace skyrl_tx::ops::cpu_kernels
