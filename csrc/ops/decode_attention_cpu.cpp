// decode_attention_cpu: one decode step's attention on float32 CPU caches (append each row's new key and value, attend
// its one query to the row's keys) in one pass; the cache write + masked SDPA in models::Attention is its twin.
#include "ops/decode_attention_cpu.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <vector>

#include "common/errors.h"
#include "ops/cpu_vector_kernels.h"

namespace skyrl_tx::ops {

bool decode_attention_cpu_applies(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache) {
  const auto float_cpu = [](const at::Tensor& t) {
    return t.is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 4 && !t.requires_grad();
  };
  // The caches are written in place, so they must be laid out as the loops read them; q is copied if need be.
  return cpu_vector_kernels_supported() && !c10::GradMode::is_enabled() && float_cpu(q) && float_cpu(k_cache) &&
         float_cpu(v_cache) && k_cache.stride(-1) == 1 && v_cache.stride(-1) == 1 && q.size(2) == 1 &&
         k_cache.size(1) == v_cache.size(1) &&
         q.size(1) % k_cache.size(1) == 0 && q.size(3) == k_cache.size(3);
}

at::Tensor decode_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                                at::Tensor& v_cache, const at::Tensor& cache_rows, const at::Tensor& positions,
                                int64_t attend_len, double scale) {
  RECORD_FUNCTION("skyrl_tx::decode_attention_cpu", std::vector<c10::IValue>());  // named in profiles (gemm-share)
  const int64_t batch = q.size(0), heads = q.size(1), kv_heads = k_cache.size(1), max_len = k_cache.size(2);
  const at::Tensor rows_of = cache_rows.to(at::kLong).contiguous(), at_position = positions.to(at::kLong).contiguous();
  const int64_t *row_p = rows_of.const_data_ptr<int64_t>(), *position_p = at_position.const_data_ptr<int64_t>();
  // A row or position outside the cache would write out of bounds: the generator never makes one, but cheaply check.
  for (int64_t b = 0; b < batch; ++b) {
    SKYRL_TX_INTERNAL_ASSERT(row_p[b] >= 0 && row_p[b] < k_cache.size(0) && position_p[b] >= 0 &&
                                 position_p[b] < max_len,
                             "decode attention: row ", row_p[b], " position ", position_p[b], " outside the cache");
  }
  SKYRL_TX_INTERNAL_ASSERT(attend_len >= 1 && attend_len <= max_len, "decode attention: attend_len ", attend_len);
  const auto unit_stride = [](const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); };
  const at::Tensor q_in = unit_stride(q), k_in = unit_stride(k), v_in = unit_stride(v);
  at::Tensor out = at::empty({batch, 1, heads, v_cache.size(3)}, q.options()).transpose(1, 2);  // [B, heads, 1, Dv]

  cpu_kernels::DecodeAttentionRows rows;
  rows.kv_heads = kv_heads;
  rows.heads_per_kv = heads / kv_heads;
  rows.dim = q.size(3);
  rows.value_dim = v_cache.size(3);
  rows.attend_len = attend_len;
  rows.scale = static_cast<float>(scale);
  for (int d = 0; d < 2; ++d) {
    rows.q_stride[d] = q_in.stride(d);
    rows.k_new_stride[d] = k_in.stride(d);
    rows.v_new_stride[d] = v_in.stride(d);
    rows.out_stride[d] = out.stride(d);
  }
  for (int d = 0; d < 3; ++d) {
    rows.k_cache_stride[d] = k_cache.stride(d);
    rows.v_cache_stride[d] = v_cache.stride(d);
  }
  const float *qp = q_in.const_data_ptr<float>(), *kp = k_in.const_data_ptr<float>();
  const float* vp = v_in.const_data_ptr<float>();
  float *k_cache_p = k_cache.data_ptr<float>(), *v_cache_p = v_cache.data_ptr<float>(), *out_p = out.data_ptr<float>();
  // A task is one (row, kv head): ~4 * heads_per_kv * keys * D flops; a few per thread amortise a task's start.
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, rows.heads_per_kv * attend_len * rows.dim));
  at::parallel_for(0, batch * kv_heads, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(rows.heads_per_kv * attend_len);  // [heads_per_kv, attend_len], this task's scratch
    cpu_kernels::decode_attention(qp, kp, vp, k_cache_p, v_cache_p, row_p, position_p, out_p, scores.data(), rows,
                                  begin, end);
  });
  return out;
}

}  // namespace skyrl_tx::ops
