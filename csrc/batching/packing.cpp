// Ragged token sequences → one batch sorted by adapter slot (right-padded rows, or packed back to back), with
// positions, the attention layout and adapter segments.
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
                           const std::vector<int64_t>& slots, int64_t vocab_size, at::Device device,
                           RowLayout layout) {
  const size_t n = inputs.size();
  SKYRL_TX_CHECK(n > 0, InvalidArgument, "batch: no sequences given");
  SKYRL_TX_CHECK(targets.size() == n && slots.size() == n, InvalidArgument, "batch: got ", n, " inputs, ",
                 targets.size(), " targets and ", slots.size(), " adapters; they must match one to one");
  PackedBatch batch;
  int64_t max_len = 0, total = 0;
  for (size_t i = 0; i < n; ++i) {
    check_tokens("input_tokens", i, inputs[i], vocab_size);
    check_tokens("target_tokens", i, targets[i], vocab_size);
    SKYRL_TX_CHECK(inputs[i].numel() > 0, InvalidArgument, "batch: sequence ", i, " is empty; send at least one token");
    SKYRL_TX_CHECK(targets[i].numel() == inputs[i].numel(), InvalidArgument, "batch: sequence ", i, " has ",
                   inputs[i].numel(), " input tokens but ", targets[i].numel(), " targets; they must be equal");
    batch.lengths.push_back(inputs[i].numel());
    max_len = std::max(max_len, inputs[i].numel());
    total += inputs[i].numel();
  }
  // Equal lengths leave nothing to pack away: padded rows are then the same tokens, in one batched attention call.
  const bool packed = layout == RowLayout::kPacked && total != max_len * static_cast<int64_t>(n);
  // order[r] = request placed r-th: by slot (each adapter one contiguous segment); padded rows keep request order
  // within an adapter (stable), packed sequences go longest first so equal lengths sit together (one batched call
  // per run where the kernel loops over sequences: models/packed_attention.h).
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    if (slots[a] != slots[b]) return slots[a] < slots[b];
    return packed && batch.lengths[a] > batch.lengths[b];
  });

  const int64_t B = packed ? 1 : static_cast<int64_t>(n), T = packed ? total : max_len;
  at::Tensor ids = at::zeros({B * T}, at::kLong);        // [B * T]
  at::Tensor tgt = at::zeros({B * T}, at::kLong);        // [B * T]
  at::Tensor valid = at::zeros({B * T}, at::kBool);      // [B * T]
  at::Tensor positions = at::arange(T, at::kLong).repeat({B});  // [B * T]; packed: restarted per sequence below
  at::Tensor owner = at::empty({B * T}, at::kLong);      // [B * T], token_request
  std::vector<int64_t> row_slots, starts;
  batch.packed_row.resize(n);
  batch.token_offset.resize(n);
  int64_t offset = 0;
  for (size_t r = 0; r < n; ++r) {
    const int64_t req = order[r], len = batch.lengths[req];
    batch.packed_row[req] = packed ? 0 : static_cast<int64_t>(r);
    batch.token_offset[req] = offset;
    ids.narrow(0, offset, len).copy_(inputs[req]);
    tgt.narrow(0, offset, len).copy_(targets[req]);
    valid.narrow(0, offset, len).fill_(true);
    owner.narrow(0, offset, packed ? len : T).fill_(req);
    if (packed) {
      positions.narrow(0, offset, len).copy_(at::arange(len, at::kLong));
      starts.push_back(offset);
    }
    row_slots.push_back(slots[req]);
    offset += packed ? len : T;
  }
  batch.input_ids = ids.view({B, T}).to(device);
  batch.target_ids = tgt.view({B, T}).to(device);
  batch.valid = valid.view({B, T}).to(device);
  batch.positions = positions.view({B, T}).to(device);
  batch.token_request = owner.to(device);
  if (packed) {
    starts.push_back(total);
    batch.mask.sequence_starts = starts;
    batch.mask.cu_seqlens = at::tensor(starts, at::kLong).to(at::kInt).to(device);  // [S + 1]
    batch.mask.max_sequence_length = max_len;
    std::vector<int64_t> sorted_lengths;
    for (int64_t req : order) sorted_lengths.push_back(batch.lengths[req]);
    batch.segments = lora::AdapterSegments::from_sorted_lengths(row_slots, sorted_lengths);
    return batch;
  }
  // No padding mask: rows are right-padded, so a real query (position t < len) already sees only real keys under
  // the causal mask, and padded positions feed nothing real (their keys are later than every real query; their
  // outputs and gradients are dropped: zero loss weight). A [B, 1, T, T] mask would cost B * T^2 bytes, and it keeps
  // SDPA off its causal fast paths (flash attention on GPUs; the CPU kernel's skipping of blocks above the diagonal).
  batch.segments = lora::AdapterSegments::from_sorted_rows(row_slots, max_len);
  return batch;
}

std::vector<at::Tensor> unpack_tokens(const at::Tensor& flat, const PackedBatch& batch) {
  std::vector<at::Tensor> out;
  out.reserve(batch.lengths.size());
  for (size_t i = 0; i < batch.lengths.size(); ++i) {
    out.push_back(flat.narrow(0, batch.token_offset[i], batch.lengths[i]));
  }
  return out;
}

}  // namespace skyrl_tx::batching
