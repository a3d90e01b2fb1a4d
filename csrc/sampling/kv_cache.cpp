// KvCache: static per-layer K/V (or recurrent state) storage for a fixed number of sequence rows, with a row allocator.
#include "sampling/kv_cache.h"

#include "common/errors.h"
#include "models/architectures.h"

namespace skyrl_tx::sampling {

KvCache::KvCache(const models::ModelConfig& config, int64_t max_rows, int64_t max_len, at::ScalarType dtype,
                 at::Device device, int64_t tensor_parallel_size)
    : used_(max_rows, false), max_len_(max_len) {
  SKYRL_TX_CHECK(max_rows >= 1 && max_len >= 2, InvalidArgument, "kv cache: need max_sampling_sequences >= 1 and ",
                 "max_sampling_length >= 2 (got ", max_rows, ", ", max_len, ")");
  auto options = at::TensorOptions().dtype(dtype).device(device);
  const std::vector<models::MixerKind> mixers = models::mixer_layout(config);
  const int64_t conv_dim = 2 * config.linear_num_key_heads * config.linear_key_head_dim +
                           config.linear_num_value_heads * config.linear_value_head_dim;
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    if (mixers[i] == models::MixerKind::kGatedDeltaNet) {  // a fixed-size state per row instead of K/V per token
      keys_.emplace_back();
      values_.emplace_back();
      // tensor parallel: this rank's heads of q, k and v (channels), and its value heads' states
      conv_states_.push_back(at::zeros({max_rows, conv_dim / tensor_parallel_size,
                                        config.linear_conv_kernel_dim - 1}, options));
      recurrent_states_.push_back(at::zeros({max_rows, config.linear_num_value_heads / tensor_parallel_size,
                                             config.linear_key_head_dim, config.linear_value_head_dim},
                                            options.dtype(at::kFloat)));
      continue;
    }
    // [rows, kv_heads, max_len, head_dim]; MLA: one latent "head" and an empty V (ModelConfig::cache_key_dim);
    // tensor parallel: this rank's KV heads only (MLA: the whole latent on every rank)
    const int64_t kv_heads = config.cache_kv_heads_per_rank(tensor_parallel_size);
    keys_.push_back(at::zeros({max_rows, kv_heads, max_len, config.cache_key_dim()}, options));
    values_.push_back(at::zeros({max_rows, kv_heads, max_len, config.cache_value_dim()}, options));
    conv_states_.emplace_back();
    recurrent_states_.emplace_back();
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
  const at::Device device = (keys_.front().defined() ? keys_.front() : conv_states_.front()).device();
  at::Tensor rows = at::tensor(dst, at::TensorOptions().dtype(at::kLong).device(device));
  for (size_t layer = 0; layer < keys_.size(); ++layer) {
    for (at::Tensor* state : {&conv_states_[layer], &recurrent_states_[layer]}) {
      if (!state->defined()) continue;
      std::vector<int64_t> sizes(state->dim(), -1);
      sizes[0] = static_cast<int64_t>(dst.size());
      state->index_copy_(0, rows, state->narrow(0, src, 1).clone().expand(sizes));  // the whole state: src's length
    }
    if (!keys_[layer].defined()) continue;
    for (at::Tensor* cache : {&keys_[layer], &values_[layer]}) {
      at::Tensor prefix = cache->select(0, src).narrow(1, 0, length);  // [kv_heads, length, D]
      at::Tensor target = cache->narrow(2, 0, length);
      target.index_copy_(0, rows, prefix.unsqueeze(0).expand({static_cast<int64_t>(dst.size()), -1, -1, -1}));
    }
  }
}

int64_t KvCache::bytes() const {
  int64_t total = 0;
  for (const std::vector<at::Tensor>* layers : {&keys_, &values_, &conv_states_, &recurrent_states_}) {
    for (const at::Tensor& t : *layers) total += t.defined() ? static_cast<int64_t>(t.nbytes()) : 0;
  }
  return total;
}

}  // namespace skyrl_tx::sampling
