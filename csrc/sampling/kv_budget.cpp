// KV-cache sizing from a memory budget: how many sequence rows fit (gpu_memory_utilization).
#include "sampling/kv_budget.h"

#include "common/errors.h"
#include "sampling/kv_cache.h"

#ifdef SKYRL_TX_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
#endif

namespace skyrl_tx::sampling {

int64_t kv_cache_row_bytes(const models::ModelConfig& config, int64_t max_len, at::ScalarType dtype,
                           int64_t tensor_parallel_size) {
  // One row on the meta device: the same shapes the real cache gets, with no memory behind them.
  return KvCache(config, 1, max_len, dtype, at::Device(at::kMeta), tensor_parallel_size).bytes();
}

int64_t kv_rows_within_device_memory(at::Device device, double fraction, int64_t row_bytes) {
  SKYRL_TX_CHECK(device.is_cuda(), InvalidArgument, "gpu_memory_utilization sizes the KV cache from a CUDA device's ",
                 "memory (device is ", device.str(), "); on a CPU set kv_cache_tokens or max_sampling_sequences");
  SKYRL_TX_CHECK(fraction > 0.0 && fraction <= 1.0 && row_bytes > 0, InvalidArgument,
                 "gpu_memory_utilization must be in (0, 1] (got ", fraction, ")");
#ifdef SKYRL_TX_WITH_CUDA
  c10::cuda::CUDAGuard guard(device);
  // Blocks the caching allocator holds but nothing uses (weight loading's temporaries) are free for the cache.
  c10::cuda::CUDACachingAllocator::emptyCache();
  size_t free_bytes = 0, total_bytes = 0;
  const cudaError_t status = cudaMemGetInfo(&free_bytes, &total_bytes);
  SKYRL_TX_CHECK(status == cudaSuccess, Internal, "gpu_memory_utilization: cudaMemGetInfo failed on ", device.str(),
                 ": ", cudaGetErrorString(status));
  const double in_use = static_cast<double>(total_bytes - free_bytes);
  const double budget = fraction * static_cast<double>(total_bytes) - in_use;
  const int64_t rows = budget > 0 ? static_cast<int64_t>(budget / static_cast<double>(row_bytes)) : 0;
  constexpr double kMiB = 1024.0 * 1024.0;
  SKYRL_TX_CHECK(rows >= 1, InvalidArgument, "gpu_memory_utilization=", fraction, " of ", device.str(), "'s ",
                 static_cast<int64_t>(total_bytes / kMiB), " MiB leaves ", static_cast<int64_t>(budget / kMiB),
                 " MiB after the ", static_cast<int64_t>(in_use / kMiB), " MiB in use, less than one KV-cache row (",
                 static_cast<int64_t>(row_bytes / kMiB), " MiB for max_sampling_length tokens): raise ",
                 "gpu_memory_utilization or lower max_sampling_length");
  return rows;
#else
  SKYRL_TX_CHECK(false, InvalidArgument, "gpu_memory_utilization: this build of skyrl_tx has no CUDA path");
  return 0;
#endif
}

}  // namespace skyrl_tx::sampling
