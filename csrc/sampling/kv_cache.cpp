// KvCache: static per-layer K/V storage for a fixed number of sequence rows (gpt-fast style), with a row allocator.
#include "sampling/kv_cache.h"

#include "common/errors.h"

namespace skyrl_tx::sampling {

KvCache::KvCache(const models::ModelConfig& config, int64_t max_rows, int64_t max_len, at::ScalarType dtype,
                 at::Device device)
    : used_(max_rows, false), max_len_(max_len) {
  SKYRL_TX_CHECK(max_rows >= 1 && max_len >= 2, InvalidArgument, "kv cache: need max_sampling_sequences >= 1 and ",
                 "max_sampling_length >= 2 (got ", max_rows, ", ", max_len, ")");
  auto options = at::TensorOptions().dtype(dtype).device(device);
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    // [rows, kv_heads, max_len, head_dim]; MLA: one latent "head" and an empty V (ModelConfig::cache_key_dim)
    keys_.push_back(at::zeros({max_rows, config.cache_kv_heads(), max_len, config.cache_key_dim()}, options));
    values_.push_back(at::zeros({max_rows, config.cache_kv_heads(), max_len, config.cache_value_dim()}, options));
  }
}

int64_t KvCache::allocate_row() {
  for (size_t row = 0; row < used_.size(); ++row) {
    if (!used_[row]) {
      used_[row] = true;
      return static_cast<int64_t>(row);
    }
  }
  return -1;
}

void KvCache::release_row(int64_t row) {
  SKYRL_TX_INTERNAL_ASSERT(row >= 0 && row < max_rows() && used_[row], "releasing a free kv row");
  used_[row] = false;
}

int64_t KvCache::free_rows() const {
  int64_t n = 0;
  for (bool u : used_) n += u ? 0 : 1;
  return n;
}

void KvCache::copy_prefix(int64_t src, const std::vector<int64_t>& dst, int64_t length) {
  if (dst.empty()) return;
  at::Tensor rows = at::tensor(dst, at::TensorOptions().dtype(at::kLong).device(keys_.front().device()));
  for (size_t layer = 0; layer < keys_.size(); ++layer) {
    for (at::Tensor* cache : {&keys_[layer], &values_[layer]}) {
      at::Tensor prefix = cache->select(0, src).narrow(1, 0, length);  // [kv_heads, length, D]
      at::Tensor target = cache->narrow(2, 0, length);
      target.index_copy_(0, rows, prefix.unsqueeze(0).expand({static_cast<int64_t>(dst.size()), -1, -1, -1}));
    }
  }
}

int64_t KvCache::bytes() const {
  int64_t total = 0;
  for (size_t i = 0; i < keys_.size(); ++i) total += keys_[i].nbytes() + values_[i].nbytes();
  return total;
}

}  // namespace skyrl_tx::sampling
