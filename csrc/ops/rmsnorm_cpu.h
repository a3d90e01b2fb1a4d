// rmsnorm_cpu: RMSNorm of float32 CPU rows in one pass forward and one backward; RmsNorm's ATen formula is its twin.
#pragma once

#include <ATen/ATen.h>

namespace skyrl_tx::ops {

/// Whether rmsnorm_cpu applies: float32 CPU x [..., dim] of any layout (a strided x is copied to contiguous rows
/// first) with a contiguous float32 weight [dim].
bool rmsnorm_cpu_applies(const at::Tensor& x, const at::Tensor& weight);

/// weight * (x / sqrt(mean(x^2) + eps)) over the last dim (Zhang & Sennrich 2019), as the ATen formula of
/// models::RmsNorm computes it, in one pass per row; autograd gives x's gradient in one more pass per row (and the
/// weight's, when it is trained, by an ATen reduction over the rows).
at::Tensor rmsnorm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps);

}  // namespace skyrl_tx::ops
