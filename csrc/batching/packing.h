// Ragged token sequences → one right-padded batch sorted by adapter slot, with masks and positions.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "lora/adapter_segments.h"
#include "models/layers.h"

namespace skyrl_tx::batching {

struct PackedBatch {
  at::Tensor input_ids;   // [B, T] int64, padded with 0
  at::Tensor target_ids;  // [B, T] int64, padded with 0
  at::Tensor valid;       // [B, T] bool, true on real tokens
  at::Tensor positions;   // [B, T] int64, 0..len-1 (padding continues counting; masked anyway)
  models::AttentionMask mask;         // undefined: right padding needs only the causal mask (packing.cpp says why)
  lora::AdapterSegments segments;     // over the flattened [B * T] tokens
  std::vector<int64_t> packed_row;    // request i lives in packed row packed_row[i]
  std::vector<int64_t> lengths;       // per request
};

/// Packs requests; rows are stably sorted by slot so every adapter is one contiguous segment.
/// inputs/targets: 1-D integer tensors of equal length per request; slots: one per request.
/// Throws InvalidArgument naming the request index for empty sequences, length mismatches and
/// token ids outside [0, vocab_size).
PackedBatch pack_sequences(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& targets,
                           const std::vector<int64_t>& slots, int64_t vocab_size, at::Device device);

/// Inverse of the packing for per-token outputs: flat [B * T] → one [length] tensor per request.
std::vector<at::Tensor> unpack_tokens(const at::Tensor& flat, const PackedBatch& batch);

}  // namespace skyrl_tx::batching
