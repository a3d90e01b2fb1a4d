// Backend's training half: full fine-tuning copies, forward/forward_backward over micro-batches, AdamW.
#include "backend/backend.h"

#include <c10/core/GradMode.h>

#include <algorithm>
#include <optional>
#include <set>

#include "backend/data_parallel.h"
#include "backend/fault_injection.h"
#include "backend/grad_transaction.h"
#include "backend/micro_batch.h"
#include "common/dtype.h"
#include "common/errors.h"
#include "models/architectures.h"

namespace skyrl_tx::backend {

void Backend::create_full_model(const std::string& model_id) {
  SKYRL_TX_CHECK(!model_id.empty(), InvalidArgument, "create_model: model id must not be empty");
  SKYRL_TX_CHECK(!experts_over_data_parallel(), InvalidArgument, "create_model: full fine-tuning (lora rank 0) with "
                 "the experts spread over the data-parallel ranks is not built; train a LoRA adapter (lora_rank > 0), "
                 "or set expert_parallel_size to 1 or to tensor_parallel_size");
  SKYRL_TX_CHECK(!full_models_.count(model_id) && !registry_.contains(model_id), Conflict, "create_model: model '",
                 model_id, "' already exists");
  SKYRL_TX_CHECK(static_cast<int64_t>(full_models_.size()) < config_.max_full_models, ResourceExhausted,
                 "create_model: ", full_models_.size(), " full fine-tuning model(s) already loaded (max_full_models=",
                 config_.max_full_models, "); unload one, use LoRA (lora_rank > 0), or raise max_full_models");
  models::WeightMap weights;
  {
    c10::NoGradGuard no_grad;
    for (const auto& [name, tensor] : model_->named_parameters()) weights[name] = tensor.clone();
  }
  models::ModelOptions options = model_->options();
  options.num_slots = 1;  // no LoRA slots of its own; slot 0 only
  options.max_rank = 1;
  options.weights_are_parts = tensor_parallel().enabled();  // a copy of this rank's parts
  auto model = std::make_unique<models::CausalLM>(model_->config(), std::move(weights), options);
  for (const auto& [name, tensor] : model->named_parameters()) tensor.requires_grad_(true);
  full_models_[model_id] = std::move(model);
  full_model_lives_[model_id] = next_life_++;  // its frozen copies' tensors are never shared with a later life's
  if (data_parallel()) zero_optimizers_.emplace(model_id, optim::ZeroAdamState(stepped_tensors(model_id), *collectives_, zero_bucket_elements()));
}

void Backend::attach_collectives(std::shared_ptr<dist::Collectives> group) {
  SKYRL_TX_CHECK(zero_optimizers_.empty() || (group && group->world_size() > 1), InvalidArgument,
                 "attach_collectives: full models hold ZeRO-sharded optimizer state; it cannot leave the group");
  SKYRL_TX_CHECK(full_models_.empty() || !tensor_parallel().enabled() || !group || group->world_size() == 1,
                 InvalidArgument, "attach_collectives: full fine-tuning with both tensor and data parallelism is not "
                 "built yet");
  collectives_ = std::move(group);
  if (!data_parallel()) return;
  for (const auto& [model_id, model] : full_models_) {
    if (zero_optimizers_.count(model_id)) continue;
    optim::ZeroAdamState zero(stepped_tensors(model_id), *collectives_, zero_bucket_elements());
    if (auto it = optimizers_.find(model_id); it != optimizers_.end()) {  // state from one process: slice it
      std::map<std::string, at::Tensor> masters = it->second.masters();  // none, or one per bfloat16 tensor
      if (!masters.empty()) {  // ZeRO's master range spans the whole layout: float32 tensors are their own master
        for (const auto& t : stepped_tensors(model_id)) {
          if (!masters.count(t.name)) masters[t.name] = t.param.detach().to(at::kFloat);
        }
      }
      zero.restore(it->second.num_steps(), it->second.moments(), masters);
      optimizers_.erase(it);
    }
    zero_optimizers_.emplace(model_id, std::move(zero));
  }
}

optim::ZeroAdamState* Backend::zero_state(const std::string& model_id) {
  auto it = zero_optimizers_.find(model_id);
  return it == zero_optimizers_.end() ? nullptr : &it->second;
}

const optim::ZeroAdamState* Backend::zero_state(const std::string& model_id) const {
  auto it = zero_optimizers_.find(model_id);
  return it == zero_optimizers_.end() ? nullptr : &it->second;
}

void Backend::remove_model(const std::string& model_id) {
  if (auto it = full_models_.find(model_id); it != full_models_.end()) {
    drop_generator(*it->second, "unload_model: model '" + model_id +
                                    "' is serving running sample requests; unload it once they finish");
    full_models_.erase(it);
    full_model_lives_.erase(model_id);
    optimizers_.erase(model_id);
    zero_optimizers_.erase(model_id);
    dimuon_.erase(model_id);
    return;
  }
  remove_adapter(model_id);
}

std::vector<optim::TrainableTensor> Backend::trainable_tensors(const std::string& model_id) const {
  std::vector<optim::TrainableTensor> out;
  if (auto it = full_models_.find(model_id); it != full_models_.end()) {
    for (const auto& [name, tensor] : it->second->named_parameters()) {
      out.push_back({name, tensor, tensor.grad(), it->second->parameter_split(name)});
    }
    return out;
  }
  const int64_t slot = registry_.slot_of(model_id);
  SKYRL_TX_CHECK(slot != 0, InvalidArgument, "training: name a model, not the base model");
  for (const auto& m : model_->lora_modules()) {
    if (!m.module->slot_enabled(slot)) continue;
    out.push_back(lora_factor(m, slot, false));
    out.push_back(lora_factor(m, slot, true));
  }
  return out;
}

std::map<std::string, at::Tensor> Backend::trainable_state(const std::string& model_id) const {
  return trainable_state(model_id, {}, false);
}

std::map<std::string, at::Tensor> Backend::trainable_state(const std::string& model_id,
                                                           const std::set<std::string>& names, bool model_dtype) const {
  std::map<std::string, at::Tensor> out;
  for (const auto& t : trainable_tensors(model_id)) {
    if (!names.empty() && !names.count(t.name)) continue;  // the same on every rank: the gathers stay in step
    const at::ScalarType dtype = model_dtype ? t.param.scalar_type() : at::kFloat;
    out[t.name] = whole(t, t.param).to(at::kCPU, dtype, false, true);  // gathered under tensor parallelism
  }
  return out;
}

std::vector<optim::TrainableTensor> Backend::stepped_tensors(const std::string& model_id) const {
  std::vector<optim::TrainableTensor> tensors = trainable_tensors(model_id);
  // Buffers (DeepSeek's router score bias) are copied and saved with the model but never stepped.
  tensors.erase(std::remove_if(tensors.begin(), tensors.end(),
                               [](const optim::TrainableTensor& t) { return models::is_buffer_name(t.name); }),
                tensors.end());
  return tensors;
}

std::map<std::string, at::Tensor> Backend::trainable_grads(const std::string& model_id) const {
  if (const optim::ZeroAdamState* zero = zero_state(model_id)) {
    std::map<std::string, at::Tensor> local = zero->gather_pending(*collectives_);  // this rank's parts, summed
    std::map<std::string, at::Tensor> out;
    for (const auto& t : trainable_tensors(model_id)) {  // whole under tensor parallelism (every rank in this order)
      auto it = local.find(t.name);
      const at::Tensor part = it != local.end() ? it->second.to(t.param.device())
                                                : at::zeros_like(t.param, t.param.options().dtype(at::kFloat));
      out[t.name] = whole(t, part).to(at::kCPU, at::kFloat, false, true);  // (buffers: no gradient, zeros)
    }
    return out;
  }
  std::map<std::string, at::Tensor> out;
  for (const auto& t : trainable_tensors(model_id)) {
    // Whole on every rank alike (a collective under tensor parallelism): zeros where no gradient accumulated yet.
    const at::Tensor local = t.grad.defined() ? t.grad : at::zeros_like(t.param, t.param.options().dtype(at::kFloat));
    out[t.name] = whole(t, local).to(at::kCPU, at::kFloat, false, true);
  }
  return out;
}

std::map<std::string, double> Backend::optim_step(const std::string& model_id, const optim::AdamParams& params) {
  std::vector<optim::TrainableTensor> tensors = stepped_tensors(model_id);
  SKYRL_TX_CHECK(!dimuon_.count(model_id), InvalidArgument, "optim_step: model '", model_id,
                 "' uses the dimuon optimizer (chosen at create_model); send optimizer_params of type dimuon "
                 "(DimuonParams), not adam_params");
  if (optim::ZeroAdamState* zero = zero_state(model_id)) {
    std::map<std::string, double> metrics = zero->step(tensors, params, *collectives_, tensor_parallel());
    free_grads(model_id);
    return metrics;
  }
  std::map<std::string, double> metrics = optimizers_[model_id].step(tensors, params, split_group());
  free_grads(model_id);
  return metrics;
}

std::map<std::string, double> Backend::optim_step(const std::string& model_id, const optim::DimuonParams& params) {
  std::vector<optim::TrainableTensor> tensors = trainable_tensors(model_id);
  auto it = dimuon_.find(model_id);
  SKYRL_TX_CHECK(it != dimuon_.end(), InvalidArgument, "optim_step: model '", model_id,
                 "' uses the adamw optimizer (chosen at create_model); send adam_params (AdamParams), not "
                 "optimizer_params of type dimuon");
  std::map<std::string, double> metrics = it->second.step(tensors, params, split_group());
  free_grads(model_id);
  return metrics;
}

void Backend::free_grads(const std::string& model_id) {
  // Freed rather than zeroed: the next batch then accumulates into fresh buffers with nothing to set aside
  // (see GradTransaction), and a model between steps holds no gradient memory.
  if (auto it = full_models_.find(model_id); it != full_models_.end()) {
    for (const auto& [name, tensor] : it->second->named_parameters()) tensor.mutable_grad() = at::Tensor();
    if (optim::ZeroAdamState* zero = zero_state(model_id)) zero->drop_pending();
  } else {
    const int64_t slot = registry_.slot_of(model_id);
    for (const auto& m : model_->lora_modules()) m.module->take_slot_grads(slot);
  }
}

void Backend::set_optimizer_kind(const std::string& model_id, const std::string& kind) {
  trainable_tensors(model_id);  // NotFound for unknown models
  SKYRL_TX_CHECK(kind == "adamw" || kind == "dimuon", InvalidArgument, "create_model: optimizer '", kind,
                 "' is not supported; use adamw or dimuon");
  SKYRL_TX_CHECK(kind != "dimuon" || !full_models_.count(model_id), InvalidArgument,
                 "create_model: the dimuon optimizer orthogonalises LoRA factor updates; full fine-tuning "
                 "(lora rank 0) uses adamw");
  if (kind == optimizer_kind(model_id)) return;
  const auto adam = optimizers_.find(model_id);
  SKYRL_TX_CHECK(adam == optimizers_.end() || adam->second.num_steps() == 0, Conflict, "model '", model_id,
                 "' has already stepped with adamw; its optimizer is fixed for its life");
  const auto dimuon = dimuon_.find(model_id);
  SKYRL_TX_CHECK(dimuon == dimuon_.end() || dimuon->second.num_steps() == 0, Conflict, "model '", model_id,
                 "' has already stepped with dimuon; its optimizer is fixed for its life");
  if (kind == "dimuon") {
    optimizers_.erase(model_id);
    dimuon_[model_id];
  } else {
    dimuon_.erase(model_id);
  }
}

std::string Backend::optimizer_kind(const std::string& model_id) const {
  return dimuon_.count(model_id) ? "dimuon" : "adamw";
}

std::vector<batching::TrainResult> Backend::forward_backward(const std::vector<batching::TrainRequest>& requests) {
  return run_requests(requests, /*train=*/true);
}

std::vector<batching::TrainResult> Backend::forward(const std::vector<batching::TrainRequest>& requests) {
  return run_requests(requests, /*train=*/false);
}

std::vector<batching::TrainResult> Backend::run_requests(const std::vector<batching::TrainRequest>& requests,
                                                         bool train) {
  // Validate everything (inputs and model ids) before computing anything, so a bad request fails fast; a
  // failure while computing (out of memory, a device error) is undone by the GradTransaction below.
  std::vector<batching::TrainRow> rows = batching::validate_requests(requests);
  std::vector<const models::CausalLM*> request_model(requests.size());
  std::vector<int64_t> request_slot(requests.size(), 0);
  for (size_t r = 0; r < requests.size(); ++r) {
    const std::string& id = requests[r].model_id;
    if (auto it = full_models_.find(id); it != full_models_.end()) {
      request_model[r] = it->second.get();
      continue;
    }
    request_slot[r] = registry_.slot_of(id);
    SKYRL_TX_CHECK(request_slot[r] != 0, InvalidArgument, "forward_backward: request ", r,
                   " has no model_id; name the model to train");
    request_model[r] = model_.get();
  }

  std::vector<batching::TrainResult> results(requests.size());
  for (size_t r = 0; r < requests.size(); ++r) results[r].loss_fn_outputs.resize(requests[r].data.size());
  std::vector<double> loss_sums(requests.size(), 0.0);

  // Rows of the shared base (all LoRA tenants together) form one group; each full model its own. In a fixed order
  // (the base, then full models by id), not by address: parallel ranks must run their collectives in the same order.
  std::vector<std::pair<const models::CausalLM*, std::vector<size_t>>> groups;
  {
    std::map<const models::CausalLM*, std::vector<size_t>> rows_of;
    for (size_t i = 0; i < rows.size(); ++i) rows_of[request_model[rows[i].request]].push_back(i);
    if (rows_of.count(model_.get())) groups.emplace_back(model_.get(), std::move(rows_of[model_.get()]));
    for (const auto& [id, full] : full_models_) {
      if (rows_of.count(full.get())) groups.emplace_back(full.get(), std::move(rows_of[full.get()]));
    }
  }
  MicroBatchOptions options{train, config_.gradient_checkpointing, config_.logprobs_chunk_tokens};
  // All-or-nothing: the batch accumulates into fresh gradients, added to the models' pending ones only once
  // every micro-batch has succeeded; if one throws, the transaction's destructor restores them exactly, so
  // the engine may rerun the requests one by one without adding any row's gradient twice.
  std::optional<GradTransaction> grads;
  if (train) {
    std::set<int64_t> slots;
    std::vector<FullModelGrads> full_models;
    for (size_t r = 0; r < requests.size(); ++r) {
      if (request_slot[r] != 0) slots.insert(request_slot[r]);
    }
    // By model id (the groups' order): parallel ranks must sum the same models' gradients in the same order, and
    // their models live at different addresses.
    for (const auto& [id, full] : full_models_) {
      for (const auto& group : groups) {
        if (group.first == full.get()) full_models.push_back({full.get(), zero_state(id)});
      }
    }
    grads.emplace(*model_, slots, full_models);
  }
  // Data parallelism: this rank computes its share of the rows; the gradients and outputs are summed below.
  const bool parallel = collectives_ && collectives_->world_size() > 1;
  const std::vector<char> mine = parallel ? rows_of_this_rank(rows, *collectives_) : std::vector<char>(rows.size(), 1);
  std::vector<std::pair<const models::CausalLM*, std::vector<size_t>>> micro_batches;
  for (const auto& [model, group_rows] : groups) {
    std::vector<size_t> row_ids;
    for (size_t id : group_rows) {
      if (mine[id]) row_ids.push_back(id);
    }
    if (row_ids.empty()) continue;
    for (auto& micro : batching::plan_micro_batches(rows, row_ids, config_.train_micro_batch_tokens,
                                                    config_.train_micro_batch_size, training_layout())) {
      micro_batches.emplace_back(model, std::move(micro));
    }
  }
  // Experts over the data-parallel ranks: every MoE layer of every micro-batch is an all-to-all, so every rank runs
  // as many micro-batches as the busiest one (padding ones of one zero-weight token), each in the same mode.
  const dist::ExpertParallel::DistinctTokens distinct_tokens(model_->expert_parallel());
  const int64_t padding = experts_over_data_parallel() ? micro_batches_short_of_busiest(micro_batches.size()) : 0;
  int64_t micro_index = 0;
  for (const auto& [model, micro] : micro_batches) {
    std::vector<const batching::TrainRow*> batch_rows;
    std::vector<int64_t> slots;
    for (size_t id : micro) {
      batch_rows.push_back(&rows[id]);
      slots.push_back(request_slot[rows[id].request]);
    }
    auto [batch, inputs] = batching::pack_training_rows(batch_rows, slots, model_config().vocab_size,
                                                        model->options().device, training_layout());
    MicroBatchOutput out = run_micro_batch(*model, batch, inputs, options);
    fault_injection::after_micro_batch(micro_index++);
    std::vector<at::Tensor> logprobs = batching::unpack_tokens(out.logprobs.to(at::kCPU), batch);
    std::vector<at::Tensor> losses = batching::unpack_tokens(out.loss.to(at::kCPU), batch);
    for (size_t k = 0; k < micro.size(); ++k) {
      const batching::TrainRow& row = rows[micro[k]];
      results[row.request].loss_fn_outputs[row.datum] = {logprobs[k].clone(), losses[k].clone(),
                                                         std::move(out.custom_values[k])};
      loss_sums[row.request] += losses[k].to(at::kDouble).sum().item<double>();
    }
  }
  for (int64_t i = 0; i < padding; ++i) run_padding_micro_batch(options);
  for (size_t r = 0; r < requests.size(); ++r) results[r].metrics["loss:sum"] = loss_sums[r];
  // Tensor parallel: the replicated LoRA factors' gradients are partial sums (each rank's shard's share).
  if (grads && tensor_parallel().enabled()) grads->sum_partial_over(tensor_parallel());
  if (parallel) {  // every rank, rows or not: the collectives need them all
    share_row_outputs(rows, mine, results, *collectives_, model_->options().device);
    if (grads) grads->all_reduce(*collectives_, /*owned_are_whole=*/experts_over_data_parallel());
  }
  for (size_t r = 0; r < requests.size(); ++r) {
    if (!requests[r].custom_loss) continue;
    // As the SDK reports a client-side custom loss: its loss and metrics, plus the linear surrogate trained on.
    std::vector<std::vector<double>> per_datum;
    for (const batching::DatumOutput& out : results[r].loss_fn_outputs) per_datum.push_back(out.custom_values);
    results[r].metrics["surrogate_loss:sum"] = results[r].metrics["loss:sum"];
    loss::add_custom_metrics(*requests[r].custom_loss, per_datum, results[r].metrics);
  }
  if (grads) grads->commit();  // last: nothing after it can fail
  return results;
}

int64_t Backend::micro_batches_short_of_busiest(size_t planned) const {
  // [1] on the model's device (an NCCL group reduces device tensors only)
  at::Tensor most = at::full({1}, static_cast<int64_t>(planned),
                             at::TensorOptions().dtype(at::kLong).device(model_->options().device));
  collectives_->all_reduce_max(most);
  return most.item<int64_t>() - static_cast<int64_t>(planned);
}

void Backend::run_padding_micro_batch(const MicroBatchOptions& options) {
  // One token of the base model with weight 0: its loss and every gradient it adds are exactly zero; it exists
  // only so this rank runs the MoE layers' exchanges the other ranks are waiting on.
  batching::TrainRow row;
  row.input_tokens = at::zeros({1}, at::kLong);   // [1]
  row.target_tokens = at::zeros({1}, at::kLong);  // [1]
  row.weights = at::zeros({1}, at::kFloat);       // [1]
  row.sampling_logprobs = row.advantages = row.clip_low = row.clip_high = at::zeros({1}, at::kFloat);  // unused
  auto [batch, inputs] = batching::pack_training_rows({&row}, {0}, model_config().vocab_size,
                                                      model_->options().device);
  run_micro_batch(*model_, batch, inputs, options);
}

}  // namespace skyrl_tx::backend
