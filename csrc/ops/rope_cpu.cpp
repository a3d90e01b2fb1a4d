// rope_cpu: rotate-half RoPE of float32 CPU q/k in one pass forward and one backward; RotaryEmbedding::apply's ATen
// formula is its twin.
#include "ops/rope_cpu.h"

#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>

#include "ops/cpu_vector_kernels.h"

namespace skyrl_tx::ops {
namespace {

// A 4-d tensor whose last dim is unit-stride (any other layout is copied to contiguous first).
at::Tensor unit_stride_rows(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

// The kernel's view of an input [B, heads, T, D], its output and the angles [B or 1, T, D].
cpu_kernels::RopeRows rope_rows(const at::Tensor& in, const at::Tensor& out, const at::Tensor& angles) {
  cpu_kernels::RopeRows rows;
  rows.heads = in.size(1);
  rows.tokens = in.size(2);
  rows.half = in.size(3) / 2;
  for (int d = 0; d < 3; ++d) {
    rows.in_stride[d] = in.stride(d);
    rows.out_stride[d] = out.stride(d);
  }
  rows.angle_stride[0] = angles.size(0) == 1 ? 0 : angles.stride(0);
  rows.angle_stride[1] = angles.stride(1);
  return rows;
}

// Rows per parallel task: about 16k elements, so a task's start is amortised.
int64_t grain_rows(int64_t dim) { return std::max<int64_t>(1, 16384 / dim); }

class RopeFunction : public torch::autograd::Function<RopeFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& strided_x, const at::Tensor& cos,
                            const at::Tensor& sin) {
    const at::Tensor x = unit_stride_rows(strided_x);
    const at::Tensor c = cos.contiguous(), s = sin.contiguous();  // [B or 1, T, D]
    at::Tensor out = at::empty_like(x);  // [B, heads, T, D], x's layout when x is dense
    const cpu_kernels::RopeRows rows = rope_rows(x, out, c);
    const float *xp = x.const_data_ptr<float>(), *cp = c.const_data_ptr<float>(), *sp = s.const_data_ptr<float>();
    float* o = out.data_ptr<float>();
    at::parallel_for(0, x.size(0) * rows.heads * rows.tokens, grain_rows(x.size(3)), [&](int64_t begin, int64_t end) {
      cpu_kernels::rope_forward(xp, cp, sp, o, rows, begin, end);
    });
    ctx->save_for_backward({c, s});
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &c = saved[0], &s = saved[1];
    const at::Tensor grad = unit_stride_rows(grads[0]);  // [B, heads, T, D]
    at::Tensor grad_x = at::empty_like(grad);
    const cpu_kernels::RopeRows rows = rope_rows(grad, grad_x, c);
    const float *gp = grad.const_data_ptr<float>(), *cp = c.const_data_ptr<float>(), *sp = s.const_data_ptr<float>();
    float* gx = grad_x.data_ptr<float>();
    at::parallel_for(0, grad.size(0) * rows.heads * rows.tokens, grain_rows(grad.size(3)),
                     [&](int64_t begin, int64_t end) { cpu_kernels::rope_backward(gp, cp, sp, gx, rows, begin, end); });
    return {grad_x, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

bool rope_cpu_applies(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  if (!cpu_vector_kernels_supported() || !x.is_cpu() || x.scalar_type() != at::kFloat || x.dim() != 4) return false;
  const auto is_angles = [&](const at::Tensor& t) {
    return t.is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 3 && t.size(2) == x.size(3) &&
           t.size(1) == x.size(2) && (t.size(0) == x.size(0) || t.size(0) == 1) && !t.requires_grad();
  };
  return x.size(3) % 2 == 0 && x.size(3) > 0 && is_angles(cos) && is_angles(sin) && cos.sizes() == sin.sizes();
}

at::Tensor rope_cpu(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return RopeFunction::apply(x, cos, sin);
}

}  // namespace skyrl_tx::ops
