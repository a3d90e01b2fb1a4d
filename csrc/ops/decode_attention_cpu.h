// decode_attention_cpu: one decode step's attention on float32 CPU caches (append each row's new key and value, attend
// its one query to the row's keys) in one pass; the cache write + masked SDPA in models::Attention is its twin.
#pragma once

#include <ATen/ATen.h>

namespace skyrl_tx::ops {

/// Whether decode_attention_cpu applies: float32 CPU q [B, heads, 1, D] (one token per row, heads a multiple of the
/// caches' kv heads) and caches [rows, kv_heads, max_len, D or value dim] with unit-stride last dims (written in
/// place), no autograd (decode runs without gradients), on a CPU that runs the loops (cpu_vector_kernels_supported).
bool decode_attention_cpu_applies(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache);

/// Writes k [B, kv_heads, 1, D] and v [B, kv_heads, 1, value_dim] into cache row cache_rows[b] at positions[b] (int64
/// [B] each), then attends q [B, heads, 1, D] to row b's keys [0, min(positions[b] + 1, attend_len)): softmax(q · k *
/// scale) weighting the values. Returns [B, heads, 1, value_dim], laid out as [B, 1, heads, value_dim] memory (the
/// heads merge by a view). What the index_put + masked SDPA it replaces computes, without the [B, 1, 1, L] mask and
/// the index machinery: 165 against 335 us per layer at batch 16 (8 heads on 4 kv heads of 64, ~90 keys; 1 thread,
/// warm caches).
at::Tensor decode_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                                at::Tensor& v_cache, const at::Tensor& cache_rows, const at::Tensor& positions,
                                int64_t attend_len, double scale);

}  // namespace skyrl_tx::ops
