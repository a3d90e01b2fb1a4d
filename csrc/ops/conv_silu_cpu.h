// conv_silu_cpu: Gated DeltaNet's depthwise causal conv1d + SiLU over [B, T, C] float32 CPU activations, one pass
// forward and two backward; models::causal_conv_silu (at::conv1d on the transposed input, then silu) is its twin.
#pragma once

#include <ATen/ATen.h>

namespace skyrl_tx::ops {

/// Whether conv_silu_cpu applies: float32 CPU x [B, T, C] with unit-stride channels (any batch and token strides:
/// a packed run's view) and a float32 weight [C, kernel], with the fused CPU ops on (cpu_vector_kernels_supported).
bool conv_silu_cpu_applies(const at::Tensor& x, const at::Tensor& weight);

/// silu(depthwise causal conv of x along T with `weight`), each sequence starting from zeros: [B, T, C] contiguous.
/// Differentiable in x and weight. The formula transposes x to [B, C, T] for at::conv1d and back, so its SiLU and the
/// SiLU's backward run across 4-byte-strided channels (4 ms per [1024, 256] on one core); this keeps [B, T, C]
/// throughout and recomputes the pre-activation in the backward instead of keeping it.
at::Tensor conv_silu_cpu(const at::Tensor& x, const at::Tensor& weight);

}  // namespace skyrl_tx::ops
