// gated_delta_step_cpu: one decode step of the gated delta rule on float32 CPU states in one pass per (row, head);
// models::recurrent_gated_delta_step is its twin.
#include "ops/gated_delta_step_cpu.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <vector>

#include "common/errors.h"
#include "ops/cpu_vector_kernels.h"

namespace skyrl_tx::ops {

bool gated_delta_step_cpu_applies(const at::Tensor& state) {
  return cpu_vector_kernels_supported() && !c10::GradMode::is_enabled() && state.is_cpu() &&
         state.scalar_type() == at::kFloat && state.dim() == 4 && !state.requires_grad() && state.stride(3) == 1 &&
         state.stride(2) == state.size(3);
}

at::Tensor gated_delta_step_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                const at::Tensor& beta, at::Tensor& state) {
  RECORD_FUNCTION("skyrl_tx::gated_delta_step_cpu", std::vector<c10::IValue>());  // named in profiles (gemm-share)
  const int64_t batch = v.size(0), heads = v.size(2), key_heads = k.size(2);
  SKYRL_TX_INTERNAL_ASSERT(q.size(1) == 1 && k.size(1) == 1 && v.size(1) == 1, "a decode step feeds one token");
  SKYRL_TX_INTERNAL_ASSERT(heads % key_heads == 0 && state.size(0) == batch && state.size(1) == heads &&
                               state.size(2) == k.size(3) && state.size(3) == v.size(3) && q.sizes() == k.sizes(),
                           "gated delta step: mismatched q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes(),
                           ", state ", state.sizes());
  // The formula computes in float32 whatever the activations' dtype; so do the loops. [B, heads, D] / [B, heads]
  const auto rows_of = [](const at::Tensor& t) {
    at::Tensor f = t.select(1, 0).to(at::kFloat);
    return f.stride(-1) == 1 ? f : f.contiguous();
  };
  const at::Tensor q_in = rows_of(q), k_in = rows_of(k), v_in = rows_of(v);
  const at::Tensor g_in = g.select(1, 0).to(at::kFloat), beta_in = beta.select(1, 0).to(at::kFloat);
  at::Tensor out = at::empty({batch, 1, heads, v.size(3)}, v.options().dtype(at::kFloat));  // [B, 1, heads, Dv]

  cpu_kernels::GatedDeltaRows rows;
  rows.heads = heads;
  rows.heads_per_key = heads / key_heads;
  rows.key_dim = k.size(3);
  rows.value_dim = v.size(3);
  for (int d = 0; d < 2; ++d) {
    rows.q_stride[d] = q_in.stride(d);
    rows.k_stride[d] = k_in.stride(d);
    rows.v_stride[d] = v_in.stride(d);
    rows.g_stride[d] = g_in.stride(d);
    rows.beta_stride[d] = beta_in.stride(d);
    rows.state_stride[d] = state.stride(d);
    rows.out_stride[d] = out.stride(d == 0 ? 0 : 2);
  }
  const float *qp = q_in.const_data_ptr<float>(), *kp = k_in.const_data_ptr<float>();
  const float *vp = v_in.const_data_ptr<float>(), *gp = g_in.const_data_ptr<float>();
  const float* beta_p = beta_in.const_data_ptr<float>();
  float *state_p = state.data_ptr<float>(), *out_p = out.data_ptr<float>();
  // A task is one (row, head): ~5 * key_dim * value_dim flops over its state; a few per thread amortise a start.
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, rows.key_dim * rows.value_dim));
  at::parallel_for(0, batch * heads, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(2 * rows.key_dim);  // this task's normalised q and k
    cpu_kernels::gated_delta_step(qp, kp, vp, gp, beta_p, state_p, out_p, scratch.data(), rows, begin, end);
  });
  return out.to(q.scalar_type());
}

}  // namespace skyrl_tx::ops
