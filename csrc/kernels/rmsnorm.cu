// Fused RMSNorm forward kernel: one block per row, float32 accumulation, bf16 or fp32 storage.
#include <cuda_bf16.h>

#include "kernels/kernels.h"

namespace skyrl_tx::kernels {
namespace {

__device__ inline float to_float(float v) { return v; }
__device__ inline float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ inline T from_float(float v);
template <> __device__ inline float from_float<float>(float v) { return v; }
template <> __device__ inline __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16(v); }

constexpr int kThreads = 256;

template <typename T>
__global__ void rmsnorm_kernel(const T* __restrict__ x, const T* __restrict__ weight, T* __restrict__ out,
                               int64_t dim, float eps) {
  const T* row = x + blockIdx.x * dim;
  T* out_row = out + blockIdx.x * dim;
  float sum = 0.f;
  for (int64_t i = threadIdx.x; i < dim; i += kThreads) {
    const float v = to_float(row[i]);
    sum += v * v;
  }
  __shared__ float partial[kThreads];
  partial[threadIdx.x] = sum;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) partial[threadIdx.x] += partial[threadIdx.x + stride];
    __syncthreads();
  }
  const float inv_rms = rsqrtf(partial[0] / static_cast<float>(dim) + eps);
  for (int64_t i = threadIdx.x; i < dim; i += kThreads) {
    // Round the normalised value to T first, as transformers does (x.to(input_dtype)) before the weight.
    const T normed = from_float<T>(to_float(row[i]) * inv_rms);
    out_row[i] = from_float<T>(to_float(weight[i]) * to_float(normed));
  }
}

}  // namespace

cudaError_t launch_rmsnorm(const void* x, const void* weight, void* out, int64_t rows, int64_t dim, float eps,
                           ElementType type, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (type == ElementType::kFloat32) {
    rmsnorm_kernel<float><<<rows, kThreads, 0, stream>>>(static_cast<const float*>(x),
                                                          static_cast<const float*>(weight),
                                                          static_cast<float*>(out), dim, eps);
  } else {
    rmsnorm_kernel<__nv_bfloat16><<<rows, kThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(x),
                                                                  static_cast<const __nv_bfloat16*>(weight),
                                                                  static_cast<__nv_bfloat16*>(out), dim, eps);
  }
  return cudaGetLastError();
}

}  // namespace skyrl_tx::kernels
