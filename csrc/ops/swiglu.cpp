// swiglu: silu(gate) * up, one fused pass forward and one backward on the CPU (float32); ATen's formula elsewhere.
#include "ops/swiglu.h"

#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include <atomic>
#include <cstdlib>
#include <string>

#include "ops/cpu_vector_kernels.h"

namespace skyrl_tx::ops {

namespace {

// Whether this CPU runs the loops at all (x86-64 with AVX2 and FMA, in a build that has them).
bool cpu_runs_the_loops() {
#if defined(SKYRL_TX_CPU_VECTOR_KERNELS) && (defined(__x86_64__) || defined(_M_X64))
  static const bool runs = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return runs;
#else
  return false;
#endif
}

// On unless SKYRL_TX_FUSED_CPU_OPS is "0"; the benchmark's in-process A/B flips it between steps.
std::atomic<bool>& fused_ops_switch() {
  static std::atomic<bool> on{[] {
    const char* mode = std::getenv("SKYRL_TX_FUSED_CPU_OPS");
    return !(mode != nullptr && std::string(mode) == "0");
  }()};
  return on;
}

}  // namespace

bool cpu_vector_kernels_supported() {
  return cpu_runs_the_loops() && fused_ops_switch().load(std::memory_order_relaxed);
}

bool set_fused_cpu_ops(bool on) {
  fused_ops_switch().store(on, std::memory_order_relaxed);
  return cpu_vector_kernels_supported();
}

namespace {

constexpr int64_t kGrain = 16384;  // elements per parallel task: big enough to amortise a task's start

class SwigluFunction : public torch::autograd::Function<SwigluFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& strided_gate,
                            const at::Tensor& strided_up) {
    const at::Tensor gate = strided_gate.contiguous(), up = strided_up.contiguous();  // no-ops for the usual inputs
    at::Tensor out = at::empty_like(gate);  // [..., width]
    const float *g = gate.const_data_ptr<float>(), *u = up.const_data_ptr<float>();
    float* o = out.data_ptr<float>();
    at::parallel_for(0, gate.numel(), kGrain, [&](int64_t begin, int64_t end) {
      cpu_kernels::swiglu_forward(g, u, o, begin, end);
    });
    ctx->save_for_backward({gate, up});
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &gate = saved[0], &up = saved[1];
    const at::Tensor grad = grads[0].contiguous();
    at::Tensor grad_gate = ctx->needs_input_grad(0) ? at::empty_like(gate) : at::Tensor();
    at::Tensor grad_up = ctx->needs_input_grad(1) ? at::empty_like(up) : at::Tensor();
    const float *d = grad.const_data_ptr<float>(), *g = gate.const_data_ptr<float>(), *u = up.const_data_ptr<float>();
    float* dg = grad_gate.defined() ? grad_gate.data_ptr<float>() : nullptr;
    float* du = grad_up.defined() ? grad_up.data_ptr<float>() : nullptr;
    at::parallel_for(0, gate.numel(), kGrain, [&](int64_t begin, int64_t end) {
      cpu_kernels::swiglu_backward(d, g, u, dg, du, begin, end);
    });
    return {grad_gate, grad_up};
  }
};

}  // namespace

bool swiglu_is_fused(const at::Tensor& gate, const at::Tensor& up) {
  // Not the inputs' layout: strided rows (views of a wider projection) take the kernel as the same rows alone do,
  // so an element's result never depends on the batch around it (rmsnorm_cpu_applies says more).
  return cpu_vector_kernels_supported() && gate.is_cpu() && up.is_cpu() && gate.scalar_type() == at::kFloat &&
         up.scalar_type() == at::kFloat && gate.sizes() == up.sizes();
}

at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up) {
  if (!swiglu_is_fused(gate, up)) return at::silu(gate) * up;
  return SwigluFunction::apply(gate, up);
}

}  // namespace skyrl_tx::ops
