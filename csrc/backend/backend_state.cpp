// Backend's checkpoint half: optimizer state out and in, trainable weights in, snapshots from saved weights.
#include "backend/backend.h"

#include <c10/core/GradMode.h>

#include "common/errors.h"

namespace skyrl_tx::backend {

namespace {

at::Tensor host_float(const at::Tensor& t) { return t.detach().to(at::kCPU, at::kFloat, false, true); }

/// The tensor named `name` in `tensors`, with `shape`; InvalidArgument naming the tensor otherwise.
const at::Tensor& expect_tensor(const std::map<std::string, at::Tensor>& tensors, const std::string& name,
                                at::IntArrayRef shape, const char* what) {
  auto it = tensors.find(name);
  SKYRL_TX_CHECK(it != tensors.end(), InvalidArgument, what, ": '", name, "' is missing");
  SKYRL_TX_CHECK(it->second.sizes() == shape, InvalidArgument, what, ": '", name, "' has shape ",
                 it->second.sizes(), ", the model expects ", shape);
  return it->second;
}

void reject_unknown(const std::map<std::string, at::Tensor>& tensors, const std::set<std::string>& known,
                    const char* what) {
  for (const auto& [name, tensor] : tensors) {
    SKYRL_TX_CHECK(known.count(name), InvalidArgument, what, ": unexpected tensor '", name,
                   "' (not a trainable tensor of this model)");
  }
}

}  // namespace

OptimizerState Backend::optimizer_state(const std::string& model_id) const {
  trainable_tensors(model_id);  // NotFound for unknown models
  OptimizerState out;
  auto it = optimizers_.find(model_id);
  if (it == optimizers_.end()) return out;
  out.step = it->second.num_steps();
  for (const auto& [name, moments] : it->second.moments()) {
    out.exp_avg[name] = host_float(moments.first);
    out.exp_avg_sq[name] = host_float(moments.second);
  }
  return out;
}

void Backend::set_optimizer_state(const std::string& model_id, const OptimizerState& state) {
  SKYRL_TX_CHECK(state.step >= 0, InvalidArgument, "load optimizer state: step must be >= 0 (got ", state.step, ")");
  std::map<std::string, std::pair<at::Tensor, at::Tensor>> moments;
  std::set<std::string> known;
  for (const auto& t : trainable_tensors(model_id)) {
    known.insert(t.name);
    // A model saved before its first optim_step has no moments: AdamW creates them lazily.
    if (state.exp_avg.empty() && state.exp_avg_sq.empty()) continue;
    const at::Tensor& m = expect_tensor(state.exp_avg, t.name, t.param.sizes(), "load optimizer state (exp_avg)");
    const at::Tensor& v = expect_tensor(state.exp_avg_sq, t.name, t.param.sizes(), "load optimizer state (exp_avg_sq)");
    const auto device = t.param.options().dtype(at::kFloat);
    moments[t.name] = {m.to(device, false, true), v.to(device, false, true)};
  }
  reject_unknown(state.exp_avg, known, "load optimizer state (exp_avg)");
  reject_unknown(state.exp_avg_sq, known, "load optimizer state (exp_avg_sq)");
  optimizers_[model_id].restore(state.step, std::move(moments));
}

void Backend::set_trainable_state(const std::string& model_id, const std::map<std::string, at::Tensor>& weights) {
  auto full = full_models_.find(model_id);
  if (full == full_models_.end()) {
    set_adapter_weights(model_id, weights);
    return;
  }
  std::vector<std::pair<at::Tensor, at::Tensor>> updates;  // (parameter, new value)
  std::set<std::string> known;
  for (const auto& [name, param] : full->second->named_parameters()) {
    known.insert(name);
    updates.push_back({param, expect_tensor(weights, name, param.sizes(), "load weights")});
  }
  reject_unknown(weights, known, "load weights");
  c10::NoGradGuard no_grad;
  for (auto& [param, value] : updates) param.copy_(value);
}

void Backend::load_snapshot(const std::string& snapshot_id, const lora::LoraConfig& lora_config,
                            const std::map<std::string, at::Tensor>& weights) {
  lora_config.validate(config_.max_lora_rank);
  SKYRL_TX_CHECK(!snapshot_id.empty() && !snapshots_.count(snapshot_id) && !registry_.contains(snapshot_id) &&
                     !full_models_.count(snapshot_id) && !frozen_models_.count(snapshot_id),
                 Conflict, "snapshot: id '", snapshot_id, "' is empty or already in use");
  Snapshot snapshot;
  snapshot.config = lora_config;
  std::set<std::string> known;
  for (const auto& m : model_->lora_modules()) {
    if (!targets_group(lora_config, m.group)) continue;
    const std::string a_name = m.name + ".lora_A.weight", b_name = m.name + ".lora_B.weight";
    known.insert(a_name);
    known.insert(b_name);
    const int64_t rank = lora_config.rank;
    const at::Tensor& a = expect_tensor(weights, a_name, {rank, m.module->in_features()}, "load sampler weights");
    const at::Tensor& b = expect_tensor(weights, b_name, {m.module->out_features(), rank}, "load sampler weights");
    snapshot.factors[m.name] = {host_float(a).clone(), host_float(b).clone()};
  }
  reject_unknown(weights, known, "load sampler weights");
  snapshots_[snapshot_id] = std::move(snapshot);
}

void Backend::load_frozen_model(const std::string& snapshot_id, models::WeightMap weights) {
  SKYRL_TX_CHECK(!snapshot_id.empty() && !snapshots_.count(snapshot_id) && !registry_.contains(snapshot_id) &&
                     !full_models_.count(snapshot_id) && !frozen_models_.count(snapshot_id),
                 Conflict, "snapshot: id '", snapshot_id, "' is empty or already in use");
  models::ModelOptions options = model_->options();
  options.num_slots = 1;  // sampled as is: no LoRA slots of its own
  options.max_rank = 1;
  frozen_models_[snapshot_id] = std::make_unique<models::CausalLM>(model_->config(), std::move(weights), options);
}

}  // namespace skyrl_tx::backend
