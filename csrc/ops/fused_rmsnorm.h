// Torch-facing entry to the fused RMSNorm kernel; the ATen formula in RmsNorm is its twin and oracle.
#pragma once

#include <ATen/ATen.h>

namespace skyrl_tx::ops {

/// True when the CUDA kernel applies: CUDA build, CUDA tensor, fp32/bf16, contiguous, no autograd.
bool can_use_fused_rmsnorm(const at::Tensor& x);
/// x: [..., dim]; weight: [dim] → same shape as x. Throws Unimplemented in a CPU-only build.
at::Tensor fused_rmsnorm(const at::Tensor& x, const at::Tensor& weight, double eps);

}  // namespace skyrl_tx::ops
