// Raw float32 loops of the fused CPU ops, compiled for AVX2 + FMA on x86-64: swiglu, rmsnorm_cpu, rope_cpu and
// decode_attention_cpu's in cpu_vector_kernels.cpp, Gated DeltaNet's (gated_delta_step_cpu, conv_silu_cpu) in
// deltanet_cpu_kernels.cpp; chunk_gated_delta_rule_cpu's are declared in chunk_delta_cpu_kernels.h.
#pragma once

#include <cstdint>

namespace skyrl_tx::ops {

/// Whether this build has the loops below and this CPU can run them (x86-64 with AVX2 and FMA), and
/// SKYRL_TX_FUSED_CPU_OPS is not "0" (A/B runs against the ATen formulas). Every fused CPU op (swiglu, rmsnorm_cpu,
/// rope_cpu, decode_attention_cpu, gated_delta_step_cpu, conv_step_cpu, conv_silu_cpu, chunk_gated_delta_rule_cpu)
/// runs when it says yes.
/// (ATen's own kernels dispatch on the CPU at run time; ours are built for the one instruction set nearly every x86-64
/// server has, behind this check.)
/// Every op decides by dtype, device and shape, never by layout: a strided row gets the arithmetic the same row alone
/// gets. rope_cpu equals its formula bit for bit; the others differ from theirs by float32 ulps, which every check
/// across computation orders allows.
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

/// Where one decode step's tensors live (element strides; every last dim is unit-stride): q [B, heads, 1, dim], the
/// new k [B, kv_heads, 1, dim] and v [B, kv_heads, 1, value_dim], the caches [rows, kv_heads, max_len, dim or
/// value_dim] and the output [B, heads, 1, value_dim]. Query head h reads kv head h / heads_per_kv (GQA).
struct DecodeAttentionRows {
  int64_t kv_heads = 0, heads_per_kv = 0, dim = 0, value_dim = 0, attend_len = 0;
  int64_t q_stride[2] = {0, 0}, k_new_stride[2] = {0, 0}, v_new_stride[2] = {0, 0};  // batch, head
  int64_t out_stride[2] = {0, 0};                                                     // batch, head
  int64_t k_cache_stride[3] = {0, 0, 0}, v_cache_stride[3] = {0, 0, 0};              // row, head, position
  float scale = 1.0f;
};
/// Tasks [begin, end) of B * kv_heads, task (b, h): writes b's new key and value of kv head h into cache row
/// cache_rows[b] at position positions[b], then attends that kv head's heads_per_kv queries to the row's keys
/// [0, min(positions[b] + 1, attend_len)): softmax of the scaled dot products, weights on the values.
/// scores: heads_per_kv * attend_len floats of the caller's.
void decode_attention(const float* q, const float* k_new, const float* v_new, float* k_cache, float* v_cache,
                      const int64_t* cache_rows, const int64_t* positions, float* out, float* scores,
                      const DecodeAttentionRows& rows, int64_t begin, int64_t end);

/// Where one gated-delta-rule decode step's tensors live (element strides; every last dim is unit-stride): q and k
/// [B, key_heads, key_dim], v and out [B, heads, value_dim], g and beta [B, heads], and the states [B, heads, key_dim,
/// value_dim] (each head's [key_dim, value_dim] matrix contiguous). Value head h reads key head h / heads_per_key.
struct GatedDeltaRows {
  int64_t heads = 0, heads_per_key = 0, key_dim = 0, value_dim = 0;
  int64_t q_stride[2] = {0, 0}, k_stride[2] = {0, 0}, v_stride[2] = {0, 0}, out_stride[2] = {0, 0};  // batch, head
  int64_t g_stride[2] = {0, 0}, beta_stride[2] = {0, 0}, state_stride[2] = {0, 0};                // batch, head
};
/// Tasks [begin, end) of B * heads, task (b, h): with q̂ = l2norm(q) / sqrt(key_dim), k̂ = l2norm(k) (x / sqrt(sum
/// x^2 + 1e-6)) and S = exp(g) * state, writes state = S + k̂ ⊗ (beta * (v - S^T k̂)) and out = state^T q̂.
/// scratch: 2 * key_dim floats of the caller's.
void gated_delta_step(const float* q, const float* k, const float* v, const float* g, const float* beta, float* state,
                      float* out, float* scratch, const GatedDeltaRows& rows, int64_t begin, int64_t end);

/// Where a depthwise causal conv over tokens reads (Gated DeltaNet's conv1d in [B, T, C] layout): x with its batch and
/// token strides (channels unit-stride), weights transposed to [kernel, C]; outputs and gradients contiguous [B, T, C].
struct CausalConvRows {
  int64_t tokens = 0, channels = 0, kernel = 0;
  int64_t x_stride[2] = {0, 0};  // batch, token
};
/// Token rows [begin, end) of B * T: pre = sum over k of w[k] * x[t - kernel + 1 + k] in window order (nothing before
/// the sequence start), out = silu(pre).
void conv_silu_forward(const float* x, const float* w, float* out, const CausalConvRows& rows, int64_t begin,
                       int64_t end);
/// Token rows [begin, end): grad_pre = grad * silu'(pre), pre recomputed from x as forward computes it.
void conv_silu_grad_pre(const float* grad, const float* x, const float* w, float* grad_pre, const CausalConvRows& rows,
                        int64_t begin, int64_t end);
/// Token rows [begin, end): grad_x[t] = sum over k of w[k] * grad_pre[t + kernel - 1 - k] (inside the sequence).
void conv_grad_input(const float* grad_pre, const float* w, float* grad_x, const CausalConvRows& rows, int64_t begin,
                     int64_t end);

}  // namespace cpu_kernels
}  // namespace skyrl_tx::ops
