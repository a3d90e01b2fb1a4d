// Ragged token sequences → one right-padded batch sorted by adapter slot, with masks and positions.
#include "batching/packing.h"

#include <algorithm>
#include <numeric>

#include "common/dtype.h"
#include "common/errors.h"

namespace skyrl_tx::batching {
namespace {

void check_tokens(const char* field, size_t index, const at::Tensor& t, int64_t vocab_size) {
  SKYRL_TX_CHECK(t.dim() == 1, InvalidArgument, "batch: ", field, "[", index, "] must be 1-D, got shape ", shape_str(t));
  SKYRL_TX_CHECK(!at::isFloatingType(t.scalar_type()) && t.scalar_type() != at::kBool, InvalidArgument, "batch: ",
                 field, "[", index, "] must hold integer token ids, got ", t.scalar_type());
  if (t.numel() == 0) return;
  const int64_t lo = t.min().item<int64_t>(), hi = t.max().item<int64_t>();
  SKYRL_TX_CHECK(lo >= 0 && hi < vocab_size, InvalidArgument, "batch: ", field, "[", index, "] has token id ",
                 (lo < 0 ? lo : hi), " outside [0, ", vocab_size, "); the model's vocab_size is ", vocab_size);
}

}  // namespace

PackedBatch pack_sequences(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& targets,
                           const std::vector<int64_t>& slots, int64_t vocab_size, at::Device device) {
  const size_t n = inputs.size();
  SKYRL_TX_CHECK(n > 0, InvalidArgument, "batch: no sequences given");
  SKYRL_TX_CHECK(targets.size() == n && slots.size() == n, InvalidArgument, "batch: got ", n, " inputs, ",
                 targets.size(), " targets and ", slots.size(), " adapters; they must match one to one");
  PackedBatch batch;
  int64_t max_len = 0;
  for (size_t i = 0; i < n; ++i) {
    check_tokens("input_tokens", i, inputs[i], vocab_size);
    check_tokens("target_tokens", i, targets[i], vocab_size);
    SKYRL_TX_CHECK(inputs[i].numel() > 0, InvalidArgument, "batch: sequence ", i, " is empty; send at least one token");
    SKYRL_TX_CHECK(targets[i].numel() == inputs[i].numel(), InvalidArgument, "batch: sequence ", i, " has ",
                   inputs[i].numel(), " input tokens but ", targets[i].numel(), " targets; they must be equal");
    batch.lengths.push_back(inputs[i].numel());
    max_len = std::max(max_len, inputs[i].numel());
  }
  // order[r] = request placed in packed row r (stable sort keeps request order within an adapter).
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return slots[a] < slots[b]; });

  const auto B = static_cast<int64_t>(n);
  at::Tensor ids = at::zeros({B, max_len}, at::kLong);    // [B, T]
  at::Tensor tgt = at::zeros({B, max_len}, at::kLong);    // [B, T]
  at::Tensor valid = at::zeros({B, max_len}, at::kBool);  // [B, T]
  std::vector<int64_t> row_slots(n);
  batch.packed_row.resize(n);
  for (int64_t row = 0; row < B; ++row) {
    const int64_t req = order[row];
    const int64_t len = batch.lengths[req];
    ids[row].narrow(0, 0, len).copy_(inputs[req]);
    tgt[row].narrow(0, 0, len).copy_(targets[req]);
    valid[row].narrow(0, 0, len).fill_(true);
    row_slots[row] = slots[req];
    batch.packed_row[req] = row;
  }
  batch.input_ids = ids.to(device);
  batch.target_ids = tgt.to(device);
  batch.valid = valid.to(device);
  batch.positions = at::arange(max_len, at::TensorOptions().dtype(at::kLong).device(device)).expand({B, max_len});
  // No padding mask: rows are right-padded, so a real query (position t < len) already sees only real keys under
  // the causal mask, and padded positions feed nothing real (their keys are later than every real query; their
  // outputs and gradients are dropped: zero loss weight). A [B, 1, T, T] mask would cost B * T^2 bytes, and it keeps
  // SDPA off its causal fast paths (flash attention on GPUs; the CPU kernel's skipping of blocks above the diagonal).
  batch.segments = lora::AdapterSegments::from_sorted_rows(row_slots, max_len);
  return batch;
}

std::vector<at::Tensor> unpack_tokens(const at::Tensor& flat, const PackedBatch& batch) {
  const int64_t max_len = batch.input_ids.size(1);
  at::Tensor rows = flat.view({-1, max_len});  // [B, T]
  std::vector<at::Tensor> out;
  out.reserve(batch.lengths.size());
  for (size_t i = 0; i < batch.lengths.size(); ++i) {
    out.push_back(rows[batch.packed_row[i]].narrow(0, 0, batch.lengths[i]));
  }
  return out;
}

}  // namespace skyrl_tx::batching
