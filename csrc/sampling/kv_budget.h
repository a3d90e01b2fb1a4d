// KV-cache sizing from a memory budget: how many sequence rows fit (gpu_memory_utilization).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "models/model_config.h"

namespace skyrl_tx::sampling {

/// Bytes one KvCache row of `max_len` tokens takes (K, V and recurrent states of every layer, this rank's heads).
int64_t kv_cache_row_bytes(const models::ModelConfig& config, int64_t max_len, at::ScalarType dtype,
                           int64_t tensor_parallel_size);

/// Rows of `row_bytes` that fit in what is left of `fraction` of `device`'s memory once everything already on it
/// (this process's weights and any other process's memory) is counted, as vLLM's gpu_memory_utilization does.
/// Throws InvalidArgument (naming gpu_memory_utilization and the sizes) when not even one row fits, or when `device`
/// is not a CUDA device.
int64_t kv_rows_within_device_memory(at::Device device, double fraction, int64_t row_bytes);

}  // namespace skyrl_tx::sampling
