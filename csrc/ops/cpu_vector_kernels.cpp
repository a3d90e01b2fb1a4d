// Raw float32 loops of the fused CPU ops (swiglu, rmsnorm_cpu, rope_cpu), compiled for AVX2 + FMA on x86-64.
// NOTE: CMake builds this file alone with -mavx2 -mfma and CPU_CAPABILITY=AVX2, so at::vec::Vectorized is ATen's
// 8-wide AVX2 vector (in its own at::vec::AVX2 namespace: no clash with default-compiled code). Nothing here may
// run before cpu_vector_kernels_supported() said yes, and no standard-library template is instantiated here (its
// out-of-line copy could be the one the linker keeps for default-compiled callers): scratch comes from the caller.
#include "ops/cpu_vector_kernels.h"

#include <ATen/cpu/vec/vec.h>

#include <cmath>

namespace skyrl_tx::ops::cpu_kernels {
namespace {

using Vec = at::vec::Vectorized<float>;

// sum(a[i] * b[i]) over [0, n) in float.
float dot(const float* a, const float* b, int64_t n) {
  Vec acc(0.0f);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) acc = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), acc);
  float sum = at::vec::vec_reduce_all<float>([](const Vec& x, const Vec& y) { return x + y; }, acc);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

}  // namespace

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

}  // namespace skyrl_tx::ops::cpu_kernels
