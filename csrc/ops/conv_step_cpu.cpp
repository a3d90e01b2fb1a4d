// conv_step_cpu: one decode token of Gated DeltaNet's depthwise causal conv1d on float32 CPU states, in one pass;
// models::causal_conv_step is its twin.
#include "ops/conv_step_cpu.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <c10/core/GradMode.h>

#include <vector>

#include "common/errors.h"
#include "ops/cpu_vector_kernels.h"

namespace skyrl_tx::ops {

bool conv_step_cpu_applies(const at::Tensor& state, const at::Tensor& weight) {
  return cpu_vector_kernels_supported() && !c10::GradMode::is_enabled() && state.is_cpu() &&
         state.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && state.dim() == 3 &&
         weight.dim() == 2 && !state.requires_grad() && state.stride(2) == 1 && state.stride(1) == state.size(2);
}

at::Tensor conv_step_cpu(const at::Tensor& x, at::Tensor& state, const at::Tensor& weight) {
  RECORD_FUNCTION("skyrl_tx::conv_step_cpu", std::vector<c10::IValue>());  // named in profiles (gemm-share)
  const int64_t batch = state.size(0), channels = state.size(1), kept = state.size(2), kernel = weight.size(1);
  SKYRL_TX_INTERNAL_ASSERT(kept == kernel - 1 && weight.size(0) == channels && x.size(0) == batch &&
                               x.size(1) == channels && x.size(2) == 1,
                           "conv step: mismatched x ", x.sizes(), ", state ", state.sizes(), ", weight ",
                           weight.sizes());
  const at::Tensor x_in = x.select(2, 0).to(at::kFloat);  // [B, C], any strides
  const at::Tensor w = weight.contiguous();                // [C, kernel]
  at::Tensor out = at::empty({batch, channels, 1}, state.options());
  const float *xp = x_in.const_data_ptr<float>(), *wp = w.const_data_ptr<float>();
  float *sp = state.data_ptr<float>(), *op = out.data_ptr<float>();
  const int64_t x_stride[2] = {x_in.stride(0), x_in.stride(1)}, state_stride = state.stride(0);
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t c = 0; c < channels; ++c) {
        float* s = sp + b * state_stride + c * kept;  // [kernel - 1], oldest first
        const float* wc = wp + c * kernel;
        const float newest = xp[b * x_stride[0] + c * x_stride[1]];
        // The window's products summed in window order; the state moves one step (oldest dropped, x appended).
        float sum = 0.0f;
        for (int64_t j = 0; j < kept; ++j) sum += s[j] * wc[j];
        sum += newest * wc[kept];
        for (int64_t j = 0; j + 1 < kept; ++j) s[j] = s[j + 1];
        if (kept > 0) s[kept - 1] = newest;
        op[b * channels + c] = sum;
      }
    }
  });
  return out;
}

}  // namespace skyrl_tx::ops
