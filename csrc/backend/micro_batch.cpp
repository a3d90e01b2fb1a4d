// Runs one packed micro-batch through a model: logprobs, per-token losses and (when training) backward.
#include "backend/micro_batch.h"

#include <c10/core/GradMode.h>

#include <algorithm>

#include "batching/train_batch.h"
#include "loss/token_logprobs.h"

namespace skyrl_tx::backend {
namespace {

// Custom losses (loss/custom_loss.h) on a no-grad pass's logprobs `all` [N]: each custom row's graph runs once with
// autograd on its own copy of the row's logprobs, giving its loss, metrics and g = dC/dlp; the training pass then
// backpropagates g·lp (loss::elementwise_loss), whose gradient is C's. Returns g [N] (0 on other tokens).
at::Tensor custom_gradients(const at::Tensor& all, const loss::LossInputs& inputs,
                            std::vector<std::vector<double>>& values) {
  at::Tensor grad = at::zeros_like(all);
  at::AutoGradMode enable_grad(true);  // also in forward-only passes: the graph is the same either way
  for (const loss::CustomLossRow& row : inputs.custom_rows) {
    at::Tensor lp = all.narrow(0, row.begin, row.length).detach().clone().requires_grad_(true);  // [n]
    std::vector<at::Tensor> args{lp};
    args.insert(args.end(), row.inputs.begin(), row.inputs.end());
    loss::CustomLoss::Result result = row.loss->evaluate(args);
    std::vector<double>& out = values[row.batch_row];
    out.push_back(result.loss.detach().to(at::kDouble).item<double>());
    for (const at::Tensor& metric : result.metrics) out.push_back(metric.to(at::kDouble).item<double>());
    if (result.loss.requires_grad()) {
      result.loss.backward();
      if (lp.grad().defined()) grad.narrow(0, row.begin, row.length).copy_(lp.grad());
    }
  }
  return grad;
}

// The head runs chunk by chunk; in training each chunk's loss is backpropagated at once into
// hidden.grad and the lm_head parameters, so only one [chunk, vocab] block of logits is ever alive.
MicroBatchOutput run_head(const models::CausalLM& model, const at::Tensor& hidden, const batching::PackedBatch& batch,
                          const loss::LossInputs& batch_inputs, const MicroBatchOptions& options) {
  const at::Tensor targets = batch.target_ids.reshape({-1});  // [N]
  const int64_t num_tokens = hidden.size(0);
  auto chunk_logprobs = [&](int64_t begin, int64_t length) {
    return loss::target_logprobs(model.output_head(), hidden.narrow(0, begin, length), targets.narrow(0, begin, length),
                                 batch.segments.slice(begin, length));
  };
  loss::LossInputs inputs = batch_inputs;
  // A sequence-level loss (gspo) needs its datum's mean log-ratio before any of the datum's tokens, which may
  // span chunks: a no-grad pass over the head first (only for such batches); forward reuses its logprobs.
  // A custom loss needs its whole datum's logprobs the same way.
  std::vector<at::Tensor> pre_pass;
  std::vector<std::vector<double>> custom_values(batch.lengths.size());
  if (inputs.has_sequence_losses || !inputs.custom_rows.empty()) {
    {
      c10::NoGradGuard no_grad;
      for (int64_t begin = 0; begin < num_tokens; begin += options.chunk_tokens)
        pre_pass.push_back(chunk_logprobs(begin, std::min(options.chunk_tokens, num_tokens - begin)));
    }
    const at::Tensor all = at::cat(pre_pass);  // [N]
    if (inputs.has_sequence_losses)
      inputs.seq_log_ratio = loss::sequence_log_ratio(all, inputs, batch.token_request,
                                                      static_cast<int64_t>(batch.lengths.size()));
    if (!inputs.custom_rows.empty()) inputs.custom_grad = custom_gradients(all, inputs, custom_values);
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
  return {at::cat(logprobs), at::cat(losses), std::move(custom_values)};
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
