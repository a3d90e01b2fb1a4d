// Runs one packed micro-batch through a model: logprobs, per-token losses and (when training) backward.
#include "backend/micro_batch.h"

#include <c10/core/GradMode.h>

#include <algorithm>

#include "batching/train_batch.h"
#include "loss/token_logprobs.h"

namespace skyrl_tx::backend {
namespace {

// The head runs chunk by chunk; in training each chunk's loss is backpropagated at once into
// hidden.grad and the lm_head parameters, so only one [chunk, vocab] block of logits is ever alive.
MicroBatchOutput run_head(const models::CausalLM& model, const at::Tensor& hidden, const batching::PackedBatch& batch,
                          const loss::LossInputs& batch_inputs, const MicroBatchOptions& options) {
  const at::Tensor targets = batch.target_ids.reshape({-1});  // [N]
  const int64_t num_tokens = hidden.size(0);
  auto chunk_logprobs = [&](int64_t begin, int64_t length) {
    return loss::target_logprobs(model.lm_head(), hidden.narrow(0, begin, length), targets.narrow(0, begin, length),
                                 batch.segments.slice(begin, length));
  };
  loss::LossInputs inputs = batch_inputs;
  // A sequence-level loss (gspo) needs its datum's mean log-ratio before any of the datum's tokens, which may
  // span chunks: a no-grad pass over the head first (only for such batches); forward reuses its logprobs.
  std::vector<at::Tensor> pre_pass;
  if (inputs.has_sequence_losses) {
    c10::NoGradGuard no_grad;
    for (int64_t begin = 0; begin < num_tokens; begin += options.chunk_tokens)
      pre_pass.push_back(chunk_logprobs(begin, std::min(options.chunk_tokens, num_tokens - begin)));
    inputs.seq_log_ratio = loss::sequence_log_ratio(at::cat(pre_pass), inputs, batch.input_ids.size(1));
  }
  std::vector<at::Tensor> logprobs, losses;
  for (int64_t begin = 0, chunk = 0; begin < num_tokens; begin += options.chunk_tokens, ++chunk) {
    const int64_t length = std::min(options.chunk_tokens, num_tokens - begin);
    at::Tensor lp = (!options.train && !pre_pass.empty()) ? pre_pass[chunk] : chunk_logprobs(begin, length);
    at::Tensor per_token = loss::elementwise_loss(lp, batching::slice_inputs(inputs, begin, length));
    if (options.train && per_token.requires_grad()) per_token.sum().backward();
    logprobs.push_back(lp.detach());
    losses.push_back(per_token.detach());
  }
  return {at::cat(logprobs), at::cat(losses)};
}

at::Tensor grad_or_zeros(const at::Tensor& leaf) {
  return leaf.grad().defined() ? leaf.grad() : at::zeros_like(leaf);
}

// Activation checkpointing: the forward keeps only each layer's input; the backward recomputes one
// layer at a time (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost").
MicroBatchOutput run_checkpointed(const models::CausalLM& model, const batching::PackedBatch& batch,
                                  const loss::LossInputs& inputs, const MicroBatchOptions& options) {
  at::Tensor embedded = model.embed(batch.input_ids);  // [B, T, hidden]; carries grad under full fine-tuning
  auto [cos, sin] = model.rope(batch.positions, embedded.scalar_type());
  std::vector<at::Tensor> layer_inputs;
  at::Tensor h = embedded.detach();
  {
    c10::NoGradGuard no_grad;
    for (int64_t i = 0; i < model.num_layers(); ++i) {
      layer_inputs.push_back(h);
      h = model.layer_forward(i, h, cos, sin, batch.mask, batch.segments);
    }
  }
  at::Tensor top = h.detach().requires_grad_(true);
  at::Tensor hidden = model.final_norm(top);  // [B * T, hidden]
  at::Tensor leaf = hidden.detach().requires_grad_(true);
  MicroBatchOutput out = run_head(model, leaf, batch, inputs, options);
  hidden.backward(grad_or_zeros(leaf));
  at::Tensor grad = grad_or_zeros(top);
  for (int64_t i = model.num_layers() - 1; i >= 0; --i) {
    at::Tensor x = layer_inputs[i].detach().requires_grad_(true);
    model.layer_forward(i, x, cos, sin, batch.mask, batch.segments).backward(grad);
    grad = grad_or_zeros(x);
  }
  if (embedded.requires_grad()) embedded.backward(grad);
  return out;
}

}  // namespace

MicroBatchOutput run_micro_batch(const models::CausalLM& model, const batching::PackedBatch& batch,
                                 const loss::LossInputs& inputs, const MicroBatchOptions& options) {
  if (!options.train) {
    c10::NoGradGuard no_grad;
    at::Tensor hidden = model.hidden_states(batch.input_ids, batch.positions, batch.mask, batch.segments);
    return run_head(model, hidden, batch, inputs, options);
  }
  if (options.checkpoint_layers) return run_checkpointed(model, batch, inputs, options);
  at::Tensor hidden = model.hidden_states(batch.input_ids, batch.positions, batch.mask, batch.segments);
  // Cut the graph at the head: chunks backprop into `leaf`, then one backward through the decoder.
  at::Tensor leaf = hidden.detach().requires_grad_(hidden.requires_grad());
  MicroBatchOutput out = run_head(model, leaf, batch, inputs, options);
  if (hidden.requires_grad()) hidden.backward(grad_or_zeros(leaf));
  return out;
}

}  // namespace skyrl_tx::backend
