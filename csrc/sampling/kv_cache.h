// KvCache: static per-layer K/V (or recurrent state) storage for a fixed number of sequence rows, with a row allocator.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "models/model_config.h"

namespace skyrl_tx::sampling {

class KvCache {
 public:
  /// Allocates [max_rows, kv_heads, max_len, head_dim] K and V per attention layer in `dtype` on `device`, and per
  /// Gated DeltaNet layer a conv state [max_rows, conv_dim, kernel - 1] and a float32 recurrent state
  /// [max_rows, value_heads, key_dim, value_dim] (their K/V entries are undefined, and attention layers' states).
  KvCache(const models::ModelConfig& config, int64_t max_rows, int64_t max_len, at::ScalarType dtype,
          at::Device device, int64_t tensor_parallel_size = 1);

  /// Lowest free row, or -1 when full. Lowest-first keeps the decode batch [0, highest used row] dense.
  int64_t allocate_row();
  void release_row(int64_t row);
  int64_t free_rows() const;
  /// Copies positions [0, length) of `src` to the rows in `dst` (all layers): a shared prompt prefilled once.
  /// Recurrent states are copied whole (they hold `src` after all its tokens), so with Gated DeltaNet layers
  /// `length` must be everything `src` holds: no prefix cache for such models.
  void copy_prefix(int64_t src, const std::vector<int64_t>& dst, int64_t length);

  const std::vector<at::Tensor>& keys() const { return keys_; }
  const std::vector<at::Tensor>& values() const { return values_; }
  const std::vector<at::Tensor>& conv_states() const { return conv_states_; }
  const std::vector<at::Tensor>& recurrent_states() const { return recurrent_states_; }
  int64_t max_rows() const { return static_cast<int64_t>(used_.size()); }
  int64_t max_len() const { return max_len_; }
  /// Bytes held by K, V and recurrent states across layers.
  int64_t bytes() const;

 private:
  std::vector<at::Tensor> keys_, values_;                 // undefined for Gated DeltaNet layers
  std::vector<at::Tensor> conv_states_, recurrent_states_;  // undefined for attention layers
  std::vector<bool> used_;
  int64_t max_len_;
};

}  // namespace skyrl_tx::sampling
