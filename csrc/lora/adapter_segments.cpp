// AdapterSegments: contiguous token ranges of a flattened batch that share one adapter slot.
#include "lora/adapter_segments.h"

#include <algorithm>

#include "common/errors.h"

namespace skyrl_tx::lora {

AdapterSegments AdapterSegments::from_sorted_rows(const std::vector<int64_t>& slot_per_row, int64_t tokens_per_row) {
  return from_sorted_lengths(slot_per_row, std::vector<int64_t>(slot_per_row.size(), tokens_per_row));
}

AdapterSegments AdapterSegments::from_sorted_lengths(const std::vector<int64_t>& slot_per_sequence,
                                                     const std::vector<int64_t>& lengths) {
  SKYRL_TX_INTERNAL_ASSERT(slot_per_sequence.size() == lengths.size(), "one length per sequence");
  std::vector<Segment> segments;
  int64_t begin = 0;
  for (size_t i = 0; i < slot_per_sequence.size(); ++i) {
    const int64_t slot = slot_per_sequence[i];
    if (!segments.empty() && segments.back().slot == slot) {
      segments.back().length += lengths[i];
    } else {
      SKYRL_TX_INTERNAL_ASSERT(segments.empty() || segments.back().slot < slot, "rows must be sorted by slot");
      segments.push_back({slot, begin, lengths[i]});
    }
    begin += lengths[i];
  }
  return AdapterSegments(std::move(segments));
}

AdapterSegments AdapterSegments::from_rows(const std::vector<int64_t>& slot_per_row, int64_t tokens_per_row) {
  std::vector<Segment> segments;
  for (size_t row = 0; row < slot_per_row.size(); ++row) {
    const int64_t slot = slot_per_row[row];
    if (!segments.empty() && segments.back().slot == slot) {
      segments.back().length += tokens_per_row;
    } else {
      segments.push_back({slot, static_cast<int64_t>(row) * tokens_per_row, tokens_per_row});
    }
  }
  return AdapterSegments(std::move(segments));
}

AdapterSegments AdapterSegments::uniform(int64_t slot, int64_t num_tokens) {
  return AdapterSegments({{slot, 0, num_tokens}});
}

AdapterSegments AdapterSegments::row_dense(at::Tensor slot_columns) {
  SKYRL_TX_INTERNAL_ASSERT(slot_columns.dim() == 2, "slot_columns must be [N, slots * max_rank]");
  AdapterSegments out;
  out.slot_columns_ = std::move(slot_columns);
  return out;
}

AdapterSegments AdapterSegments::slice(int64_t begin, int64_t length) const {
  SKYRL_TX_INTERNAL_ASSERT(!row_dense(), "row-dense segments cannot be sliced");
  std::vector<Segment> out;
  const int64_t end = begin + length;
  for (const Segment& s : segments_) {
    const int64_t lo = std::max(begin, s.begin);
    const int64_t hi = std::min(end, s.begin + s.length);
    if (lo < hi) out.push_back({s.slot, lo - begin, hi - lo});
  }
  return AdapterSegments(std::move(out));
}

const at::Tensor& AdapterSegments::slot_columns_on(at::Device device, int64_t num_slots, int64_t max_rank) const {
  if (row_dense()) return slot_columns_;
  at::Tensor& cache = slot_columns_cache_;
  if (!cache.defined() || cache.device() != device || cache.size(1) != num_slots * max_rank) {
    std::vector<int64_t> slots(num_tokens(), 0);
    for (const Segment& s : segments_) std::fill_n(slots.begin() + s.begin, s.length, s.slot);
    cache = lora::slot_columns(at::tensor(slots, at::kLong).to(device), num_slots, max_rank);  // [N, S * R]
  }
  return cache;
}

at::Tensor slot_columns(const at::Tensor& row_slot, int64_t num_slots, int64_t max_rank) {
  at::Tensor column_slot = at::arange(num_slots * max_rank, row_slot.options()).div(max_rank, "floor");  // [S * R]
  return column_slot.unsqueeze(0).eq(row_slot.unsqueeze(1)).to(at::kFloat);
}

int64_t AdapterSegments::num_tokens() const {
  if (row_dense()) return slot_columns_.size(0);
  int64_t n = 0;
  for (const Segment& s : segments_) n += s.length;
  return n;
}

bool AdapterSegments::only_base() const {
  if (row_dense()) return false;
  return std::all_of(segments_.begin(), segments_.end(), [](const Segment& s) { return s.slot == 0; });
}

}  // namespace skyrl_tx::lora
