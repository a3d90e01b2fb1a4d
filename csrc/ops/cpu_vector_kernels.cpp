// Raw float32 loops of the fused CPU ops (swiglu, rmsnorm_cpu), compiled for AVX2 + FMA on x86-64.
// NOTE: CMake builds this file alone with -mavx2 -mfma and CPU_CAPABILITY=AVX2, so at::vec::Vectorized is ATen's
// 8-wide AVX2 vector (in its own at::vec::AVX2 namespace: no clash with default-compiled code). Nothing here may
// run before cpu_vector_kernels_available() said yes, and no standard-library template is instantiated here (its
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

}  // namespace skyrl_tx::ops::cpu_kernels
