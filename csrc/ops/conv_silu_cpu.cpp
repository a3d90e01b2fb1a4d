// conv_silu_cpu: Gated DeltaNet's depthwise causal conv1d + SiLU over [B, T, C] float32 CPU activations, one pass
// forward and two backward; models::causal_conv_silu is its twin.
#include "ops/conv_silu_cpu.h"

#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <vector>

#include "ops/cpu_vector_kernels.h"

namespace skyrl_tx::ops {
namespace {

cpu_kernels::CausalConvRows rows_of(const at::Tensor& x, int64_t kernel) {
  cpu_kernels::CausalConvRows rows;
  rows.tokens = x.size(1);
  rows.channels = x.size(2);
  rows.kernel = kernel;
  rows.x_stride[0] = x.stride(0);
  rows.x_stride[1] = x.stride(1);
  return rows;
}

// Token rows per parallel task: a row is C channels times `kernel` products.
int64_t grain_of(const cpu_kernels::CausalConvRows& rows) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, rows.channels * rows.kernel));
}

class ConvSiluFunction : public torch::autograd::Function<ConvSiluFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight) {
    const at::Tensor w = weight.t().contiguous();  // [kernel, C]: a vector of channels per tap
    const cpu_kernels::CausalConvRows rows = rows_of(x, weight.size(1));
    at::Tensor out = at::empty(x.sizes(), x.options());  // [B, T, C]
    const float *xp = x.const_data_ptr<float>(), *wp = w.const_data_ptr<float>();
    float* op = out.data_ptr<float>();
    at::parallel_for(0, x.size(0) * rows.tokens, grain_of(rows), [&](int64_t begin, int64_t end) {
      cpu_kernels::conv_silu_forward(xp, wp, op, rows, begin, end);
    });
    ctx->save_for_backward({x, weight});
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1];
    const at::Tensor w = weight.t().contiguous(), grad = grads[0].contiguous();  // [kernel, C], [B, T, C]
    const int64_t kernel = weight.size(1), tokens = x.size(1);
    const cpu_kernels::CausalConvRows rows = rows_of(x, kernel);
    const int64_t total_rows = x.size(0) * tokens;
    at::Tensor grad_pre = at::empty(x.sizes(), x.options());  // [B, T, C]: the gradient at the pre-activation
    const float *xp = x.const_data_ptr<float>(), *wp = w.const_data_ptr<float>(), *gp = grad.const_data_ptr<float>();
    float* pre_p = grad_pre.data_ptr<float>();
    at::parallel_for(0, total_rows, grain_of(rows), [&](int64_t begin, int64_t end) {
      cpu_kernels::conv_silu_grad_pre(gp, xp, wp, pre_p, rows, begin, end);
    });
    at::Tensor grad_x, grad_weight;
    if (ctx->needs_input_grad(0)) {
      grad_x = at::empty(x.sizes(), x.options());
      float* gx = grad_x.data_ptr<float>();
      at::parallel_for(0, total_rows, grain_of(rows), [&](int64_t begin, int64_t end) {
        cpu_kernels::conv_grad_input(pre_p, wp, gx, rows, begin, end);
      });
    }
    if (ctx->needs_input_grad(1)) {  // a full fine-tune's conv weight: tap k pairs token t with input t - lag
      std::vector<at::Tensor> taps;
      for (int64_t k = 0; k < kernel; ++k) {
        const int64_t lag = kernel - 1 - k, span = tokens - lag;
        taps.push_back(span > 0 ? (grad_pre.narrow(1, lag, span) * x.narrow(1, 0, span)).sum(at::IntArrayRef{0, 1})
                                : at::zeros({x.size(2)}, x.options()));
      }
      grad_weight = at::stack(taps, 1);  // [C, kernel]
    }
    return {grad_x, grad_weight};
  }
};

}  // namespace

bool conv_silu_cpu_applies(const at::Tensor& x, const at::Tensor& weight) {
  return cpu_vector_kernels_supported() && x.is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 3 &&
         x.stride(2) == 1 && weight.is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 2 &&
         weight.size(0) == x.size(2);
}

at::Tensor conv_silu_cpu(const at::Tensor& x, const at::Tensor& weight) { return ConvSiluFunction::apply(x, weight); }

}  // namespace skyrl_tx::ops
