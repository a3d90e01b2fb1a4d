// AdapterSegments: contiguous token ranges of a flattened batch that share one adapter slot.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace skyrl_tx::lora {

struct Segment {
  int64_t slot;   // 0 = base model, no adapter
  int64_t begin;  // first token row in the flattened [N, hidden] activations
  int64_t length;
};

/// Rows of a batch sorted by slot, so each adapter's LoRA is one matmul over a contiguous range
/// (the ATen twin of a segmented "SGMV" kernel, Chen et al. 2023, Punica).
class AdapterSegments {
 public:
  AdapterSegments() = default;
  explicit AdapterSegments(std::vector<Segment> segments) : segments_(std::move(segments)) {}

  /// slot_per_row must already be sorted (non-decreasing); each row holds `tokens_per_row` tokens.
  static AdapterSegments from_sorted_rows(const std::vector<int64_t>& slot_per_row, int64_t tokens_per_row);
  /// Sequences laid back to back (packed rows), sorted by slot; sequence i holds lengths[i] tokens.
  static AdapterSegments from_sorted_lengths(const std::vector<int64_t>& slot_per_sequence,
                                             const std::vector<int64_t>& lengths);
  /// Any row order: adjacent rows with the same slot merge; a slot may own several segments.
  static AdapterSegments from_rows(const std::vector<int64_t>& slot_per_row, int64_t tokens_per_row);
  /// All `num_tokens` rows use one slot.
  static AdapterSegments uniform(int64_t slot, int64_t num_tokens);
  /// Row-dense (inference): slot_columns [N, num_slots * max_rank] float, 1 where the column belongs to row n's
  /// slot. Every LoRA layer then applies all slots in two matmuls, with no host-side segment structure: the
  /// shape a CUDA graph can capture once and replay for any assignment of rows to adapters.
  static AdapterSegments row_dense(at::Tensor slot_columns);

  /// The segments overlapping [begin, begin + length), clipped and rebased to start at 0.
  AdapterSegments slice(int64_t begin, int64_t length) const;
  const std::vector<Segment>& segments() const { return segments_; }
  int64_t num_tokens() const;
  bool only_base() const;
  bool row_dense() const { return slot_columns_.defined(); }
  const at::Tensor& slot_columns() const { return slot_columns_; }
  /// Segmented only: the row-dense form of these segments, float [N, num_slots * max_rank] on `device`, 1 on
  /// the columns of each row's slot. Built once and shared by every layer (autograd saves it once).
  const at::Tensor& slot_columns_on(at::Device device, int64_t num_slots, int64_t max_rank) const;

 private:
  std::vector<Segment> segments_;  // empty when row-dense
  at::Tensor slot_columns_;        // row-dense only
  mutable at::Tensor slot_columns_cache_;  // slot_columns_on()
};

/// row_slot: int64 [N], each row's slot → float [N, num_slots * max_rank], 1 on the columns of the row's slot
/// (column c belongs to slot c / max_rank). The row-dense LoRA mask; device ops only (CUDA-graph capturable).
at::Tensor slot_columns(const at::Tensor& row_slot, int64_t num_slots, int64_t max_rank);

}  // namespace skyrl_tx::lora
