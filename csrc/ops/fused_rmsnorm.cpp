// Torch-facing entry to the fused RMSNorm kernel; the ATen formula in RmsNorm is its twin and oracle.
#include "ops/fused_rmsnorm.h"

#include <c10/core/GradMode.h>

#include "common/errors.h"

#ifdef SKYRL_TX_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/kernels.h"
#endif

namespace skyrl_tx::ops {

bool can_use_fused_rmsnorm(const at::Tensor& x) {
#ifdef SKYRL_TX_WITH_CUDA
  return x.is_cuda() && x.is_contiguous() && !c10::GradMode::is_enabled() &&
         (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16);
#else
  (void)x;
  return false;
#endif
}

at::Tensor fused_rmsnorm(const at::Tensor& x, const at::Tensor& weight, double eps) {
#ifdef SKYRL_TX_WITH_CUDA
  SKYRL_TX_CHECK(x.is_cuda() && weight.is_cuda() && weight.scalar_type() == x.scalar_type(), InvalidArgument,
                 "fused_rmsnorm: x and weight must be CUDA tensors of one dtype");
  SKYRL_TX_CHECK(x.dim() >= 1 && x.size(-1) > 0 && x.is_contiguous() && weight.numel() == x.size(-1),
                 InvalidArgument, "fused_rmsnorm: x must be contiguous [..., dim > 0] and weight [dim] (got x ",
                 x.sizes(), ", weight ", weight.sizes(), ")");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty_like(x);
  const int64_t dim = x.size(-1);
  const auto type = x.scalar_type() == at::kFloat ? kernels::ElementType::kFloat32 : kernels::ElementType::kBFloat16;
  const cudaError_t status = kernels::launch_rmsnorm(x.data_ptr(), weight.contiguous().data_ptr(), out.data_ptr(),
                                                     x.numel() / dim, dim, static_cast<float>(eps), type,
                                                     c10::cuda::getCurrentCUDAStream());
  SKYRL_TX_CHECK(status == cudaSuccess, Internal, "fused_rmsnorm: kernel launch failed: ", cudaGetErrorString(status));
  return out;
#else
  (void)x; (void)weight; (void)eps;
  throw Unimplemented("fused_rmsnorm: this build of skyrl_tx has no CUDA path; reinstall with nvcc visible");
#endif
}

}  // namespace skyrl_tx::ops
