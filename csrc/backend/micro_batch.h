// Runs one packed micro-batch through a model: logprobs, per-token losses and (when training) backward.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "batching/packing.h"
#include "loss/losses.h"
#include "models/causal_lm.h"

namespace skyrl_tx::backend {

struct MicroBatchOptions {
  bool train = false;              // run backward, accumulating into the parameters' .grad
  bool checkpoint_layers = false;  // keep only layer inputs; recompute each layer during backward
  int64_t chunk_tokens = 1024;     // [chunk, vocab] logits alive at once, forward and backward
};

struct MicroBatchOutput {
  at::Tensor logprobs;  // [B * T] float32, detached
  at::Tensor loss;      // [B * T] float32 per-token loss, detached; 0 on padding
  /// Per row of the micro-batch (its order in pack_training_rows): a custom loss's [loss, metrics...]; empty for
  /// other losses.
  std::vector<std::vector<double>> custom_values;
};

/// The loss is the plain sum of per-token losses, so micro-batches and chunks add up exactly.
MicroBatchOutput run_micro_batch(const models::CausalLM& model, const batching::PackedBatch& batch,
                                 const loss::LossInputs& inputs, const MicroBatchOptions& options);

}  // namespace skyrl_tx::backend
