// Backend's checkpoint half: optimizer state out and in, trainable weights in, snapshots from saved weights.
#include "backend/backend.h"

#include <c10/core/GradMode.h>

#include "common/errors.h"
#include "models/architectures.h"

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
  out.kind = optimizer_kind(model_id);
  if (auto d = dimuon_.find(model_id); d != dimuon_.end()) {
    out.step = d->second.num_steps();
    for (const optim::TrainableTensor& t : trainable_tensors(model_id)) {  // whole under tensor parallelism
      auto m = d->second.momentum().find(t.name);
      if (m != d->second.momentum().end()) out.momentum[t.name] = host_float(whole(t, m->second));
    }
    return out;
  }
  if (const optim::ZeroAdamState* zero = zero_state(model_id)) {  // collective: every rank gathers the ranges
    out.step = zero->num_steps();
    std::map<std::string, std::pair<at::Tensor, at::Tensor>> local = zero->gather_moments(*collectives_);
    std::map<std::string, at::Tensor> masters = zero->gather_masters(*collectives_);
    for (const optim::TrainableTensor& t : trainable_tensors(model_id)) {  // whole under tensor parallelism
      auto it = local.find(t.name);
      if (it == local.end()) continue;
      out.exp_avg[t.name] = host_float(whole(t, it->second.first.to(t.param.device())));
      out.exp_avg_sq[t.name] = host_float(whole(t, it->second.second.to(t.param.device())));
      auto master = masters.find(t.name);  // the layout's float32 tensors have none worth saving: they are the weight
      if (master != masters.end() && t.param.scalar_type() != at::kFloat) {
        out.master[t.name] = host_float(whole(t, master->second.to(t.param.device())));
      }
    }
    return out;
  }
  auto it = optimizers_.find(model_id);
  if (it == optimizers_.end()) return out;
  out.step = it->second.num_steps();
  // Whole moments (gathered under tensor parallelism), in the tensors' order: the same collectives on every rank.
  for (const optim::TrainableTensor& t : trainable_tensors(model_id)) {
    auto moments = it->second.moments().find(t.name);
    if (moments == it->second.moments().end()) continue;
    out.exp_avg[t.name] = host_float(whole(t, moments->second.first));
    out.exp_avg_sq[t.name] = host_float(whole(t, moments->second.second));
    auto master = it->second.masters().find(t.name);
    if (master != it->second.masters().end()) out.master[t.name] = host_float(whole(t, master->second));
  }
  return out;
}

void Backend::set_optimizer_state(const std::string& model_id, const OptimizerState& state) {
  SKYRL_TX_CHECK(state.step >= 0, InvalidArgument, "load optimizer state: step must be >= 0 (got ", state.step, ")");
  const std::vector<optim::TrainableTensor> tensors = trainable_tensors(model_id);
  const std::string kind = optimizer_kind(model_id);
  SKYRL_TX_CHECK(state.kind == kind, InvalidArgument, "load optimizer state: the checkpoint holds ", state.kind,
                 " optimizer state, but model '", model_id, "' uses ", kind,
                 " (chosen at create_model); load the weights only, or create the model with the ", state.kind,
                 " optimizer");
  std::set<std::string> known;
  for (const auto& t : tensors) known.insert(t.name);
  const auto device = [](const optim::TrainableTensor& t) { return t.param.options().dtype(at::kFloat); };
  if (kind == "dimuon") {
    SKYRL_TX_CHECK(state.exp_avg.empty() && state.exp_avg_sq.empty() && state.master.empty(), InvalidArgument,
                   "load optimizer state: dimuon state holds no AdamW moments or master weights");
    std::map<std::string, at::Tensor> momentum;
    for (const auto& t : tensors) {
      if (state.momentum.empty()) break;  // saved before its first optim_step: created lazily
      const at::Tensor& m = expect_tensor(state.momentum, t.name, whole_shape(t), "load optimizer state (momentum)");
      momentum[t.name] = part(t, m).to(device(t), false, true);
    }
    reject_unknown(state.momentum, known, "load optimizer state (momentum)");
    dimuon_[model_id].restore(state.step, std::move(momentum));
    return;
  }
  SKYRL_TX_CHECK(state.momentum.empty(), InvalidArgument, "load optimizer state: adamw state holds no momentum");
  std::map<std::string, std::pair<at::Tensor, at::Tensor>> moments;
  for (const auto& t : tensors) {
    // A model saved before its first optim_step has no moments: AdamW creates them lazily.
    if (state.exp_avg.empty() && state.exp_avg_sq.empty()) continue;
    const at::Tensor& m = expect_tensor(state.exp_avg, t.name, whole_shape(t), "load optimizer state (exp_avg)");
    const at::Tensor& v = expect_tensor(state.exp_avg_sq, t.name, whole_shape(t), "load optimizer state (exp_avg_sq)");
    moments[t.name] = {part(t, m).to(device(t), false, true), part(t, v).to(device(t), false, true)};
  }
  reject_unknown(state.exp_avg, known, "load optimizer state (exp_avg)");
  reject_unknown(state.exp_avg_sq, known, "load optimizer state (exp_avg_sq)");
  // Float32 master weights of the stepped tensors stored below float32. Each must round to the weight the model
  // holds now (the weights are loaded first, from the same checkpoint): a master is what the next step updates
  // and casts into the weight, so a stale one would silently replace the loaded weights.
  std::map<std::string, at::Tensor> masters;
  for (const auto& t : tensors) {
    if (state.master.empty() || t.param.scalar_type() == at::kFloat || models::is_buffer_name(t.name)) continue;
    const at::Tensor& w = expect_tensor(state.master, t.name, whole_shape(t), "load optimizer state (master)");
    at::Tensor master = part(t, w).to(device(t), false, true).contiguous();
    SKYRL_TX_CHECK(at::equal(master.to(t.param.scalar_type()), t.param), InvalidArgument,
                   "load optimizer state: the float32 master weight of '", t.name, "' does not round to the model's ",
                   t.param.scalar_type(), " weight; load the weights saved with this optimizer state first");
    masters[t.name] = std::move(master);
  }
  reject_unknown(state.master, known, "load optimizer state (master)");
  if (optim::ZeroAdamState* zero = zero_state(model_id)) {
    if (!masters.empty()) {  // ZeRO's master range spans the whole layout: float32 tensors are their own master
      for (const auto& t : stepped_tensors(model_id)) {
        if (!masters.count(t.name)) masters[t.name] = t.param.detach().to(at::kFloat);
      }
    }
    zero->restore(state.step, moments, masters);  // this rank's range only
    return;
  }
  optimizers_[model_id].restore(state.step, std::move(moments), std::move(masters));
}

int64_t Backend::optimizer_state_bytes(const std::string& model_id) const {
  int64_t bytes = 0;
  const std::vector<optim::TrainableTensor> tensors = trainable_tensors(model_id);  // NotFound for unknown models
  if (const optim::ZeroAdamState* zero = zero_state(model_id)) return zero->local_bytes();
  for (const auto& t : tensors) bytes += t.grad.defined() ? int64_t(t.grad.nbytes()) : 0;
  if (auto d = dimuon_.find(model_id); d != dimuon_.end()) {
    for (const auto& [name, m] : d->second.momentum()) bytes += m.nbytes();
  } else if (auto it = optimizers_.find(model_id); it != optimizers_.end()) {
    for (const auto& [name, moments] : it->second.moments()) bytes += moments.first.nbytes() + moments.second.nbytes();
    for (const auto& [name, master] : it->second.masters()) bytes += master.nbytes();
  }
  return bytes;
}

void Backend::set_trainable_state(const std::string& model_id, const std::map<std::string, at::Tensor>& weights) {
  auto full = full_models_.find(model_id);
  if (full == full_models_.end()) {
    set_adapter_weights(model_id, weights);
    return;
  }
  std::vector<std::pair<at::Tensor, at::Tensor>> updates;  // (parameter, new value: this rank's part)
  std::set<std::string> known;
  for (const optim::TrainableTensor& t : trainable_tensors(model_id)) {
    known.insert(t.name);
    updates.push_back({t.param, part(t, expect_tensor(weights, t.name, whole_shape(t), "load weights"))});
  }
  reject_unknown(weights, known, "load weights");
  c10::NoGradGuard no_grad;
  for (auto& [param, value] : updates) param.copy_(value);
  // The old masters would overwrite the loaded weights at the next step: it rebuilds them from these instead.
  if (auto it = optimizers_.find(model_id); it != optimizers_.end()) it->second.drop_masters();
  if (optim::ZeroAdamState* zero = zero_state(model_id)) zero->drop_master();
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
    // The factors' whole shapes at the snapshot's rank; this rank keeps its part (tensor parallelism).
    const int64_t rank = lora_config.rank;
    optim::TrainableTensor factor_a{a_name, at::empty({rank, m.module->in_features()}, at::kFloat), {}, {}};
    optim::TrainableTensor factor_b{b_name, at::empty({m.module->out_features(), rank}, at::kFloat), {}, {}};
    if (split_group().enabled()) {
      factor_a.split = lora_split(m, false, factor_a.param.sizes());
      factor_b.split = lora_split(m, true, factor_b.param.sizes());
    }
    const at::Tensor& a = expect_tensor(weights, a_name, whole_shape(factor_a), "load sampler weights");
    const at::Tensor& b = expect_tensor(weights, b_name, whole_shape(factor_b), "load sampler weights");
    snapshot.factors[m.name] = {host_float(part(factor_a, a)).clone(), host_float(part(factor_b, b)).clone()};
  }
  reject_unknown(weights, known, "load sampler weights");
  snapshots_[snapshot_id] = std::move(snapshot);
}

void Backend::load_frozen_model(const std::string& snapshot_id, models::WeightMap weights) {
  add_frozen_model(snapshot_id, std::move(weights), /*parts=*/false);
}

void Backend::add_frozen_model(const std::string& snapshot_id, models::WeightMap weights, bool parts, bool adopt) {
  SKYRL_TX_CHECK(!snapshot_id.empty() && !snapshots_.count(snapshot_id) && !registry_.contains(snapshot_id) &&
                     !full_models_.count(snapshot_id) && !frozen_models_.count(snapshot_id),
                 Conflict, "snapshot: id '", snapshot_id, "' is empty or already in use");
  models::ModelOptions options = model_->options();
  options.num_slots = 1;  // sampled as is: no LoRA slots of its own
  options.max_rank = 1;
  options.weights_are_parts = parts;
  options.adopt_weights = adopt;
  frozen_models_[snapshot_id] = std::make_unique<models::CausalLM>(model_->config(), std::move(weights), options);
}

std::map<std::string, at::Tensor> Backend::frozen_model_weights(const std::string& snapshot_id) const {
  auto it = frozen_models_.find(snapshot_id);
  SKYRL_TX_CHECK(it != frozen_models_.end(), NotFound, "frozen model '", snapshot_id, "' is not loaded");
  std::map<std::string, at::Tensor> out;
  for (const auto& [name, tensor] : it->second->named_parameters()) {  // whole: gathered under tensor parallelism
    out[name] = tensor_parallel().whole(tensor, it->second->parameter_split(name)).to(at::kCPU);
  }
  return out;
}

}  // namespace skyrl_tx::backend
