// Raw float32 loops of the fused CPU ops (swiglu, rmsnorm_cpu, rope_cpu), compiled for AVX2 + FMA on x86-64.
#pragma once

#include <cstdint>

namespace skyrl_tx::ops {

/// Whether this build has the loops below and this CPU can run them (x86-64 with AVX2 and FMA), and
/// SKYRL_TX_FUSED_CPU_OPS is not "0" (A/B runs against the ATen formulas). Every fused CPU op (swiglu, rmsnorm_cpu,
/// rope_cpu) runs when it says yes. (ATen's own kernels dispatch on the CPU at run time; ours are built for the one
/// instruction set nearly every x86-64 server has, behind this check.) Every op decides by dtype, device and shape,
/// never by layout: a strided row gets the arithmetic the same row alone gets. rope_cpu equals its formula bit for
/// bit; swiglu and rmsnorm_cpu differ from theirs by float32 ulps, which every check across computation orders allows.
bool cpu_vector_kernels_supported();

/// Turns every fused CPU op on or off for the ops chosen from now on (the benchmark's in-process A/B of the fused
/// ops against their formulas); call it between steps, never while one runs. Returns cpu_vector_kernels_supported().
bool set_fused_cpu_ops(bool on);

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

/// Where the rows of a rotate-half RoPE live: x-like tensors are [B, heads, T, 2 * half] with element strides per
/// dim (the last dim's is 1), cos/sin [B or 1, T, 2 * half] with theirs (a broadcast dim's stride is 0).
struct RopeRows {
  int64_t heads = 0, tokens = 0, half = 0;
  int64_t in_stride[3] = {0, 0, 0};   // the input's (x forward, grad backward) batch, head, token strides
  int64_t out_stride[3] = {0, 0, 0};  // the output's
  int64_t angle_stride[2] = {0, 0};   // cos/sin's batch and token strides
};
/// Rows [begin, end) of B * heads * T: out = x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1].
void rope_forward(const float* x, const float* cos, const float* sin, float* out, const RopeRows& rows, int64_t begin,
                  int64_t end);
/// Rows [begin, end): grad_x = grad * cos + rotate_half^T(grad * sin), rotate_half^T(y) = [y2, -y1].
void rope_backward(const float* grad, const float* cos, const float* sin, float* grad_x, const RopeRows& rows,
                   int64_t begin, int64_t end);

}  // namespace cpu_kernels
}  // namespace skyrl_tx::ops
