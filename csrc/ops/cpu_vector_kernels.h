// Raw float32 loops of the fused CPU ops (swiglu, rmsnorm_cpu), compiled for AVX2 + FMA on x86-64.
#pragma once

#include <cstdint>

namespace skyrl_tx::ops {

/// Whether this build has the loops below and this CPU can run them (x86-64 with AVX2 and FMA); the ops take
/// their ATen formulas otherwise. (ATen's own kernels dispatch on the CPU at run time; ours are built for the
/// one instruction set nearly every x86-64 server has, behind this check.) Opt-in for now: only with
/// SKYRL_TX_FUSED_CPU_OPS=1 in the environment. With them on, two end-to-end checks that compare results bit for bit
/// or at 1e-6 across different computation orders (a sampler checkpoint sampled again after a prefix-cache hit;
/// tiny-deepseek-v3 split over two tensor-parallel ranks) came out one float32 ulp apart; until that is understood,
/// the default keeps ATen's formulas.
bool cpu_vector_kernels_available();

namespace cpu_kernels {

/// out = g * sigmoid(g) * u over [begin, end).
void swiglu_forward(const float* g, const float* u, float* out, int64_t begin, int64_t end);
/// grad_g = grad * u * s * (1 + g * (1 - s)), grad_u = grad * g * s with s = sigmoid(g), over [begin, end);
/// either output may be null (not wanted).
void swiglu_backward(const float* grad, const float* g, const float* u, float* grad_g, float* grad_u, int64_t begin,
                     int64_t end);
/// Rows [begin, end) of x [rows, dim]: rstd[r] = 1 / sqrt(mean(x_r^2) + eps), out_r = w * (x_r * rstd[r]).
void rmsnorm_forward(const float* x, const float* w, float eps, int64_t dim, float* out, float* rstd, int64_t begin,
                     int64_t end);
/// Rows [begin, end): grad_x_r = rstd * (g - x̂ * mean(g * x̂)) with g = grad_r * w and x̂ = x_r * rstd;
/// scratch: [dim] floats of the caller's.
void rmsnorm_backward(const float* grad, const float* x, const float* w, const float* rstd, int64_t dim,
                      float* grad_x, float* scratch, int64_t begin, int64_t end);

}  // namespace cpu_kernels
}  // namespace skyrl_tx::ops
