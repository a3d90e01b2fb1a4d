// KvCache: static per-layer K/V storage for a fixed number of sequence rows (gpt-fast style), with a row allocator.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "models/model_config.h"

namespace skyrl_tx::sampling {

class KvCache {
 public:
  /// Allocates [max_rows, kv_heads, max_len, head_dim] K and V per layer in `dtype` on `device`.
  KvCache(const models::ModelConfig& config, int64_t max_rows, int64_t max_len, at::ScalarType dtype,
          at::Device device);

  /// Lowest free row, or -1 when full. Lowest-first keeps the decode batch [0, highest used row] dense.
  int64_t allocate_row();
  void release_row(int64_t row);
  int64_t free_rows() const;
  /// Copies positions [0, length) of `src` to the rows in `dst` (all layers): a shared prompt prefilled once.
  void copy_prefix(int64_t src, const std::vector<int64_t>& dst, int64_t length);

  const std::vector<at::Tensor>& keys() const { return keys_; }
  const std::vector<at::Tensor>& values() const { return values_; }
  int64_t max_rows() const { return static_cast<int64_t>(used_.size()); }
  int64_t max_len() const { return max_len_; }
  /// Bytes held by K and V across layers.
  int64_t bytes() const;

 private:
  std::vector<at::Tensor> keys_, values_;
  std::vector<bool> used_;
  int64_t max_len_;
};

}  // namespace skyrl_tx::sampling
