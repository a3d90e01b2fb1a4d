// swiglu: silu(gate) * up, one fused pass forward and one backward on the CPU (float32); ATen's formula elsewhere.
#pragma once

#include <ATen/ATen.h>

namespace skyrl_tx::ops {

/// gate, up: [..., width] of one shape → silu(gate) * up (Shazeer 2020). Float32 CPU tensors of any layout take the
/// fused kernel (strided views are copied to contiguous rows first; forward: one read of each input, one write;
/// backward: one pass giving both input gradients, from the inputs alone, so no silu(gate) is kept for the
/// backward); other dtypes and devices compute at::silu(gate) * up, the kernel's twin and test oracle.
at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up);

/// Whether swiglu takes the fused kernel for these inputs.
bool swiglu_is_fused(const at::Tensor& gate, const at::Tensor& up);

}  // namespace skyrl_tx::ops
