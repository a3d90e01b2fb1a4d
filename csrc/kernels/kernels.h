// Host launchers of the CUDA kernels: raw pointers, sizes and a stream only (no torch headers).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace skyrl_tx::kernels {

enum class ElementType { kFloat32, kBFloat16 };

/// out[r, :] = weight * (x[r, :] * rsqrt(mean(x[r, :]^2) + eps)), math in float32, rounded once to the
/// element type before the weight product (matching transformers' RMSNorm). x, out: [rows, dim]; weight: [dim].
cudaError_t launch_rmsnorm(const void* x, const void* weight, void* out, int64_t rows, int64_t dim, float eps,
                           ElementType type, cudaStream_t stream);

}  // namespace skyrl_tx::kernels
