// Ragged token sequences → one batch sorted by adapter slot (right-padded rows, or packed back to back), with
// positions, the attention layout and adapter segments.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "lora/adapter_segments.h"
#include "models/layers.h"

namespace skyrl_tx::batching {

/// How sequences become rows. Padded: one sequence per row, right-padded to the longest (what a KV cache needs).
/// Packed: every sequence back to back in one row [1, total tokens], no padding, attention kept inside each sequence
/// (AttentionMask::sequence_starts): a batch of mixed lengths does no padded work. Packing falls back to padded
/// rows when every length is equal, since those rows have no padding and run as one batched attention call.
/// Either way sequences are grouped by adapter slot; packed ones go longest first within a slot.
enum class RowLayout { kPadded, kPacked };

struct PackedBatch {
  at::Tensor input_ids;   // [B, T] int64, padded with 0 (packed: [1, total tokens])
  at::Tensor target_ids;  // [B, T] int64, padded with 0
  at::Tensor valid;       // [B, T] bool, true on real tokens
  at::Tensor positions;   // [B, T] int64, 0..len-1 per sequence (padding continues counting; masked anyway)
  /// Padded: undefined mask (right padding needs only the causal mask; packing.cpp says why). Packed: the
  /// sequence boundaries.
  models::AttentionMask mask;
  lora::AdapterSegments segments;     // over the flattened [B * T] tokens
  std::vector<int64_t> packed_row;    // request i lives in row packed_row[i] (packed: always 0)
  std::vector<int64_t> token_offset;  // request i's first token in the flattened [B * T] tokens
  std::vector<int64_t> lengths;       // per request
  /// [B * T] int64 on the device: the request each flattened token belongs to (padding: its row's request).
  at::Tensor token_request;
  bool packed() const { return !mask.sequence_starts.empty(); }
};

/// Packs requests; rows are stably sorted by slot so every adapter is one contiguous segment.
/// inputs/targets: 1-D integer tensors of equal length per request; slots: one per request.
/// Throws InvalidArgument naming the request index for empty sequences, length mismatches and
/// token ids outside [0, vocab_size).
PackedBatch pack_sequences(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& targets,
                           const std::vector<int64_t>& slots, int64_t vocab_size, at::Device device,
                           RowLayout layout = RowLayout::kPadded);

/// Inverse of the packing for per-token outputs: flat [B * T] → one [length] tensor per request.
std::vector<at::Tensor> unpack_tokens(const at::Tensor& flat, const PackedBatch& batch);

}  // namespace skyrl_tx::batching
