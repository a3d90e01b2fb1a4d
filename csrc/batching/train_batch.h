// Tinker training requests → validated rows, token-budgeted micro-batches and per-token loss inputs.
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "batching/packing.h"
#include "loss/losses.h"

namespace skyrl_tx::batching {

/// One pre-shifted training sequence: input_tokens[i] predicts loss_fn_inputs["target_tokens"][i].
struct TrainDatum {
  at::Tensor input_tokens;                          // [N] integer
  std::map<std::string, at::Tensor> loss_fn_inputs;  // each [N]: target_tokens (int), weights/logprobs/... (float)
};

struct TrainRequest {
  std::string model_id;
  std::vector<TrainDatum> data;
  std::string loss_fn = "cross_entropy";
  std::map<std::string, double> loss_fn_config;
  std::shared_ptr<const loss::CustomLoss> custom_loss;  // set exactly when loss_fn is "custom"
};

struct DatumOutput {
  at::Tensor logprobs;          // [N] float32
  at::Tensor elementwise_loss;  // [N] float32
  std::vector<double> custom_values;  // loss "custom": the datum's loss, then its metrics in the graph's order
};

struct TrainResult {
  std::vector<DatumOutput> loss_fn_outputs;  // one per datum, in order
  std::map<std::string, double> metrics;     // "name:reduction" keys
};

/// A validated datum as one batch row.
struct TrainRow {
  size_t request = 0, datum = 0;
  at::Tensor input_tokens, target_tokens;  // [N] int64
  loss::LossKind kind = loss::LossKind::kCrossEntropy;
  at::Tensor weights, sampling_logprobs, advantages, clip_low, clip_high;  // [N] float32
  at::Tensor ratio_mask;  // [N] float32, gspo only (undefined otherwise): the sequence ratio's tokens
  double beta = 0.0;
  const loss::CustomLoss* custom = nullptr;  // loss "custom": its graph and inputs (graph order, logprobs excluded)
  std::vector<at::Tensor> custom_inputs;
  int64_t length() const { return input_tokens.numel(); }
};

/// Validates every request (loss name, config keys, required/unknown inputs, lengths, dtypes) and
/// flattens its data into rows. Throws InvalidArgument naming the request, datum and key.
std::vector<TrainRow> validate_requests(const std::vector<TrainRequest>& requests);

/// Splits row indices into micro-batches whose size stays within `token_budget` (padded: rows × longest row;
/// packed: the rows' tokens), and of at most `max_rows` rows (0: no row limit); a single longer row gets a
/// micro-batch of its own. Longest rows first.
std::vector<std::vector<size_t>> plan_micro_batches(const std::vector<TrainRow>& rows,
                                                    const std::vector<size_t>& row_ids, int64_t token_budget,
                                                    int64_t max_rows = 0, RowLayout layout = RowLayout::kPadded);

/// Packs rows (with their adapter slots) into a batch (pack_sequences' layout) plus flat [B * T] per-token loss
/// inputs.
std::pair<PackedBatch, loss::LossInputs> pack_training_rows(const std::vector<const TrainRow*>& rows,
                                                            const std::vector<int64_t>& slots, int64_t vocab_size,
                                                            at::Device device,
                                                            RowLayout layout = RowLayout::kPadded);

/// The per-token inputs restricted to flattened tokens [begin, begin + length).
loss::LossInputs slice_inputs(const loss::LossInputs& inputs, int64_t begin, int64_t length);

}  // namespace skyrl_tx::batching
