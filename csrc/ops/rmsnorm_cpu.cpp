// rmsnorm_cpu: RMSNorm of float32 CPU rows in one pass forward and one backward; RmsNorm's ATen formula is its twin.
#include "ops/rmsnorm_cpu.h"

#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <vector>

#include "ops/cpu_vector_kernels.h"

namespace skyrl_tx::ops {
namespace {

class RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& strided_x,
                            const at::Tensor& weight, double eps) {
    const at::Tensor x = strided_x.contiguous();  // a no-op for the usual contiguous rows
    const int64_t dim = x.size(-1), rows = x.numel() / dim;
    at::Tensor out = at::empty_like(x);                // [..., dim]
    at::Tensor rstd = at::empty({rows}, x.options());  // [rows]: 1 / sqrt(mean(x^2) + eps)
    const float *xp = x.const_data_ptr<float>(), *w = weight.const_data_ptr<float>();
    float *o = out.data_ptr<float>(), *r = rstd.data_ptr<float>();
    at::parallel_for(0, rows, grain_rows(dim), [&](int64_t begin, int64_t end) {
      cpu_kernels::rmsnorm_forward(xp, w, static_cast<float>(eps), dim, o, r, begin, end);
    });
    ctx->save_for_backward({x, weight, rstd});
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1], &rstd = saved[2];
    const at::Tensor grad = grads[0].contiguous();  // [..., dim]
    const int64_t dim = x.size(-1), rows = x.numel() / dim;
    at::Tensor grad_x;
    if (ctx->needs_input_grad(0)) {
      grad_x = at::empty_like(x);
      const float *xp = x.const_data_ptr<float>(), *w = weight.const_data_ptr<float>();
      const float *d = grad.const_data_ptr<float>(), *r = rstd.const_data_ptr<float>();
      float* gx = grad_x.data_ptr<float>();
      at::parallel_for(0, rows, grain_rows(dim), [&](int64_t begin, int64_t end) {
        std::vector<float> scratch(dim);  // [dim]
        cpu_kernels::rmsnorm_backward(d, xp, w, r, dim, gx, scratch.data(), begin, end);
      });
    }
    at::Tensor grad_w;
    if (ctx->needs_input_grad(1)) {  // trained norms (full fine-tuning): sum over rows of grad * x̂
      grad_w = (grad.view({rows, dim}) * (x.view({rows, dim}) * rstd.unsqueeze(1))).sum(0);  // [dim]
    }
    return {grad_x, grad_w, at::Tensor()};
  }

 private:
  // Rows per parallel task: about 16k elements, so a task's start is amortised.
  static int64_t grain_rows(int64_t dim) { return std::max<int64_t>(1, 16384 / dim); }
};

}  // namespace

bool rmsnorm_cpu_applies(const at::Tensor& x, const at::Tensor& weight) {
  // Not x's layout: a row strided out of a wider tensor (a narrow, or several rows of a batch) must take the same
  // arithmetic as the same row alone, which is contiguous (one row of a narrow is), or a token's activations would
  // change with the batch around it by an ulp.
  return cpu_vector_kernels_supported() && x.is_cpu() && x.scalar_type() == at::kFloat && x.dim() >= 1 &&
         x.size(-1) > 0 && weight.is_cpu() && weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
         weight.numel() == x.size(-1);
}

at::Tensor rmsnorm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return RmsNormFunction::apply(x, weight, eps);
}

}  // namespace skyrl_tx::ops
