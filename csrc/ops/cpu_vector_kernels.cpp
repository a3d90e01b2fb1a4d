// Raw float32 loops of the fused CPU ops (swiglu, rmsnorm_cpu, rope_cpu, decode_attention_cpu), compiled for AVX2 +
// FMA on x86-64; Gated DeltaNet's are in deltanet_cpu_kernels.cpp.
// NOTE: CMake builds this file alone with -mavx2 -mfma and CPU_CAPABILITY=AVX2, so at::vec::Vectorized is ATen's
// 8-wide AVX2 vector (in its own at::vec::AVX2 namespace: no clash with default-compiled code). Nothing here may
// run before cpu_vector_kernels_supported() said yes, and no standard-library template is instantiated here (its
// out-of-line copy could be the one the linker keeps for default-compiled callers): scratch comes from the caller.
#include "ops/cpu_vector_kernels.h"

#include <cmath>

#include "ops/cpu_vector_math.h"

namespace skyrl_tx::ops::cpu_kernels {

// NOTE: sigmoid from exp_u20 (ATen's polynomial exp, within 20 ulp: a relative error below 3e-6, far inside the
// 1e-5 logprob parity), 1.6x faster here than the 1-ulp Sleef exp. A ragged tail runs the same vector code on a
// partial load: an element's result never depends on where it sits in the tensor (a scalar tail would round
// differently, so one token's activations would change with the batch around it).
void swiglu_forward(const float* g, const float* u, float* out, int64_t begin, int64_t end) {
  const Vec one(1.0f);
  const auto step = [&](int64_t i, int64_t n) {
    const Vec gv = Vec::loadu(g + i, n), uv = Vec::loadu(u + i, n);
    (gv / (one + gv.neg().exp_u20()) * uv).store(out + i, n);
  };
  int64_t i = begin;
  for (; i + Vec::size() <= end; i += Vec::size()) step(i, Vec::size());
  if (i < end) step(i, end - i);
}

void swiglu_backward(const float* grad, const float* g, const float* u, float* grad_g, float* grad_u, int64_t begin,
                     int64_t end) {
  const Vec one(1.0f);
  const auto step = [&](int64_t i, int64_t n) {
    const Vec gv = Vec::loadu(g + i, n), dv = Vec::loadu(grad + i, n);
    const Vec sig = one / (one + gv.neg().exp_u20());
    if (grad_g != nullptr) (dv * Vec::loadu(u + i, n) * sig * (one + gv * (one - sig))).store(grad_g + i, n);
    if (grad_u != nullptr) (dv * gv * sig).store(grad_u + i, n);
  };
  int64_t i = begin;
  for (; i + Vec::size() <= end; i += Vec::size()) step(i, Vec::size());
  if (i < end) step(i, end - i);
}

void rmsnorm_forward(const float* x, const float* w, float eps, int64_t dim, float* out, float* rstd, int64_t begin,
                     int64_t end) {
  for (int64_t row = begin; row < end; ++row) {
    const float* xr = x + row * dim;
    const float inv = 1.0f / std::sqrt(dot(xr, xr, dim) / static_cast<float>(dim) + eps);
    rstd[row] = inv;
    const Vec inv_v(inv);
    float* orow = out + row * dim;
    int64_t i = 0;
    // w * (x * rstd): the ATen formula's order of rounding.
    for (; i + Vec::size() <= dim; i += Vec::size()) (Vec::loadu(w + i) * (Vec::loadu(xr + i) * inv_v)).store(orow + i);
    for (; i < dim; ++i) orow[i] = w[i] * (xr[i] * inv);
  }
}

void rmsnorm_backward(const float* grad, const float* x, const float* w, const float* rstd, int64_t dim,
                      float* grad_x, float* scratch, int64_t begin, int64_t end) {
  float* g = scratch;  // [dim]: grad_r * w
  for (int64_t row = begin; row < end; ++row) {
    const float *xr = x + row * dim, *dr = grad + row * dim;
    int64_t i = 0;
    for (; i + Vec::size() <= dim; i += Vec::size()) (Vec::loadu(dr + i) * Vec::loadu(w + i)).store(g + i);
    for (; i < dim; ++i) g[i] = dr[i] * w[i];
    const float inv = rstd[row];
    const float coef = dot(g, xr, dim) * inv * inv / static_cast<float>(dim);  // mean(g * x̂) * rstd
    const Vec inv_v(inv), coef_v(coef);
    float* out = grad_x + row * dim;
    for (i = 0; i + Vec::size() <= dim; i += Vec::size()) {
      (inv_v * (Vec::loadu(g + i) - Vec::loadu(xr + i) * coef_v)).store(out + i);
    }
    for (; i < dim; ++i) out[i] = inv * (g[i] - xr[i] * coef);
  }
}

namespace {

// Row r of B * heads * T: (batch, head, token) → element offsets of the input, the output and the cos/sin row.
struct RopeRow {
  int64_t in, out, angle;
};

RopeRow rope_row(const RopeRows& rows, int64_t r) {
  const int64_t token = r % rows.tokens, head = (r / rows.tokens) % rows.heads, batch = r / (rows.tokens * rows.heads);
  return {batch * rows.in_stride[0] + head * rows.in_stride[1] + token * rows.in_stride[2],
          batch * rows.out_stride[0] + head * rows.out_stride[1] + token * rows.out_stride[2],
          batch * rows.angle_stride[0] + token * rows.angle_stride[1]};
}

}  // namespace

// The ATen formula's order: each product rounded, then the sum (this file builds with -ffp-contract=off: no FMA
// is made of a product and a sum), so the kernel equals its twin bit for bit.
void rope_forward(const float* x, const float* cos, const float* sin, float* out, const RopeRows& rows, int64_t begin,
                  int64_t end) {
  const int64_t half = rows.half;
  for (int64_t r = begin; r < end; ++r) {
    const RopeRow at = rope_row(rows, r);
    const float *x1 = x + at.in, *x2 = x1 + half, *c = cos + at.angle, *s = sin + at.angle;
    float *o1 = out + at.out, *o2 = o1 + half;
    for (int64_t i = 0; i < half; i += Vec::size()) {
      const int64_t n = half - i < Vec::size() ? half - i : Vec::size();
      const Vec a = Vec::loadu(x1 + i, n), b = Vec::loadu(x2 + i, n);
      (a * Vec::loadu(c + i, n) + b.neg() * Vec::loadu(s + i, n)).store(o1 + i, n);
      (b * Vec::loadu(c + half + i, n) + a * Vec::loadu(s + half + i, n)).store(o2 + i, n);
    }
  }
}

void rope_backward(const float* grad, const float* cos, const float* sin, float* grad_x, const RopeRows& rows,
                   int64_t begin, int64_t end) {
  const int64_t half = rows.half;
  for (int64_t r = begin; r < end; ++r) {
    const RopeRow at = rope_row(rows, r);
    const float *g1 = grad + at.in, *g2 = g1 + half, *c = cos + at.angle, *s = sin + at.angle;
    float *o1 = grad_x + at.out, *o2 = o1 + half;
    for (int64_t i = 0; i < half; i += Vec::size()) {
      const int64_t n = half - i < Vec::size() ? half - i : Vec::size();
      const Vec a = Vec::loadu(g1 + i, n), b = Vec::loadu(g2 + i, n);
      (a * Vec::loadu(c + i, n) + b * Vec::loadu(s + half + i, n)).store(o1 + i, n);
      (b * Vec::loadu(c + half + i, n) - a * Vec::loadu(s + i, n)).store(o2 + i, n);
    }
  }
}

namespace {

// The sums of four vectors' lanes, each in one fixed tree (AVX2: two rounds of hadd, then the two 128-bit halves), so
// a sum never depends on which vectors share its call.
void sum_lanes4(const Vec& a, const Vec& b, const Vec& c, const Vec& d, float* out) {
#if defined(CPU_CAPABILITY_AVX2)
  const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));  // [a b c d | a b c d] halves
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1)));
#else  // a generic build never runs these loops (cpu_vector_kernels_supported says no); this only keeps it compiling
  const auto add = [](const Vec& x, const Vec& y) { return x + y; };
  out[0] = at::vec::vec_reduce_all<float>(add, a);
  out[1] = at::vec::vec_reduce_all<float>(add, b);
  out[2] = at::vec::vec_reduce_all<float>(add, c);
  out[3] = at::vec::vec_reduce_all<float>(add, d);
#endif
}

// scores[j] = scale * (q · key j) for keys [0, keys) of a row (key j at k + j * key_stride), four keys at a time:
// four independent FMA chains instead of one chain and one horizontal sum per key. A missing fourth key of the last
// group reads key 0 again and is dropped. Partial vector loads at a ragged head dim: a score depends only on q and
// its key, never on the keys around it.
void key_scores(const float* q, const float* k, int64_t key_stride, int64_t keys, int64_t dim, float scale,
                float* scores) {
  float four[4];
  for (int64_t j = 0; j < keys; j += 4) {
    const float* key[4];
    for (int64_t i = 0; i < 4; ++i) key[i] = k + (j + i < keys ? j + i : 0) * key_stride;
    Vec a0(0.0f), a1(0.0f), a2(0.0f), a3(0.0f);
    for (int64_t d = 0; d < dim; d += Vec::size()) {
      const int64_t n = lanes(dim - d);
      const Vec qv = Vec::loadu(q + d, n);
      a0 = at::vec::fmadd(qv, Vec::loadu(key[0] + d, n), a0);
      a1 = at::vec::fmadd(qv, Vec::loadu(key[1] + d, n), a1);
      a2 = at::vec::fmadd(qv, Vec::loadu(key[2] + d, n), a2);
      a3 = at::vec::fmadd(qv, Vec::loadu(key[3] + d, n), a3);
    }
    sum_lanes4(a0, a1, a2, a3, four);
    for (int64_t i = 0; i < 4 && j + i < keys; ++i) scores[j + i] = four[i] * scale;
  }
}

// scores[0, keys) → their softmax in place.
void softmax_in_place(float* scores, int64_t keys) {
  const Vec lowest(-INFINITY);
  Vec max_v = lowest;
  for (int64_t j = 0; j < keys; j += Vec::size()) {
    max_v = at::vec::maximum(max_v, Vec::set(lowest, Vec::loadu(scores + j, lanes(keys - j)), lanes(keys - j)));
  }
  max_v = Vec(at::vec::vec_reduce_all<float>([](const Vec& x, const Vec& y) { return at::vec::maximum(x, y); }, max_v));
  Vec total(0.0f);
  for (int64_t j = 0; j < keys; j += Vec::size()) {
    const int64_t n = lanes(keys - j);
    const Vec e = (Vec::loadu(scores + j, n) - max_v).exp();
    e.store(scores + j, n);
    total = total + Vec::set(Vec(0.0f), e, n);  // lanes past n stay zero
  }
  const Vec inv(1.0f / at::vec::vec_reduce_all<float>([](const Vec& x, const Vec& y) { return x + y; }, total));
  for (int64_t j = 0; j < keys; j += Vec::size()) {
    const int64_t n = lanes(keys - j);
    (Vec::loadu(scores + j, n) * inv).store(scores + j, n);
  }
}

constexpr int64_t kValueBlock = 8;  // vectors of the output held in registers while the keys stream past

// out[d0, d0 + kValueBlock * 8) = sum over keys j of weights[j] * value j's same columns, in key order, the block's
// accumulators in registers.
void weighted_value_block(const float* weights, const float* values, int64_t value_stride, int64_t keys, float* out) {
  Vec acc[kValueBlock];
  for (int64_t c = 0; c < kValueBlock; ++c) acc[c] = Vec(0.0f);
  for (int64_t j = 0; j < keys; ++j) {
    const Vec weight(weights[j]);
    const float* value = values + j * value_stride;
    for (int64_t c = 0; c < kValueBlock; ++c) {
      acc[c] = at::vec::fmadd(weight, Vec::loadu(value + c * Vec::size()), acc[c]);
    }
  }
  for (int64_t c = 0; c < kValueBlock; ++c) acc[c].store(out + c * Vec::size());
}

// out[0, value_dim) = sum over keys j of weights[j] * value j (at values + j * value_stride), in key order: whole
// blocks in registers, a narrower rest (value dims not a multiple of 64) accumulated in out itself.
void weighted_values(const float* weights, const float* values, int64_t value_stride, int64_t keys, int64_t value_dim,
                     float* out) {
  int64_t d0 = 0;
  for (; d0 + kValueBlock * Vec::size() <= value_dim; d0 += kValueBlock * Vec::size()) {
    weighted_value_block(weights, values + d0, value_stride, keys, out + d0);
  }
  for (int64_t d = d0; d < value_dim; d += Vec::size()) Vec(0.0f).store(out + d, lanes(value_dim - d));
  for (int64_t j = 0; j < keys && d0 < value_dim; ++j) {
    const Vec weight(weights[j]);
    const float* value = values + j * value_stride;
    for (int64_t d = d0; d < value_dim; d += Vec::size()) {
      const int64_t n = lanes(value_dim - d);
      at::vec::fmadd(weight, Vec::loadu(value + d, n), Vec::loadu(out + d, n)).store(out + d, n);
    }
  }
}

}  // namespace

// Per (row, kv head): the cache write, then for each of its query heads the scores, their softmax and the weighted
// sum of values. Every sum runs in key order: a token's result depends only on its own query and cache row, never on
// the batch around it.
void decode_attention(const float* q, const float* k_new, const float* v_new, float* k_cache, float* v_cache,
                      const int64_t* cache_rows, const int64_t* positions, float* out, float* scores,
                      const DecodeAttentionRows& rows, int64_t begin, int64_t end) {
  const int64_t dim = rows.dim, value_dim = rows.value_dim;
  const int64_t key_stride = rows.k_cache_stride[2], value_stride = rows.v_cache_stride[2];
  for (int64_t task = begin; task < end; ++task) {
    const int64_t b = task / rows.kv_heads, h = task % rows.kv_heads, position = positions[b];
    // the row's keys [max_len, dim] and values [max_len, value_dim] of this kv head
    float* k_row = k_cache + cache_rows[b] * rows.k_cache_stride[0] + h * rows.k_cache_stride[1];
    float* v_row = v_cache + cache_rows[b] * rows.v_cache_stride[0] + h * rows.v_cache_stride[1];
    const float* k_in = k_new + b * rows.k_new_stride[0] + h * rows.k_new_stride[1];
    const float* v_in = v_new + b * rows.v_new_stride[0] + h * rows.v_new_stride[1];
    for (int64_t i = 0; i < dim; ++i) k_row[position * key_stride + i] = k_in[i];
    for (int64_t i = 0; i < value_dim; ++i) v_row[position * value_stride + i] = v_in[i];
    const int64_t keys = position + 1 < rows.attend_len ? position + 1 : rows.attend_len;
    for (int64_t g = 0; g < rows.heads_per_kv; ++g) {
      const int64_t head = h * rows.heads_per_kv + g;
      float* s = scores + g * rows.attend_len;
      key_scores(q + b * rows.q_stride[0] + head * rows.q_stride[1], k_row, key_stride, keys, dim, rows.scale, s);
      softmax_in_place(s, keys);
      float* o = out + b * rows.out_stride[0] + head * rows.out_stride[1];  // [value_dim]
      weighted_values(s, v_row, value_stride, keys, value_dim, o);
    }
  }
}

}  // namespace skyrl_tx::ops::cpu_kernels
