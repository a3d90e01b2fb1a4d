// Backend's frozen full models: snapshots of a full fine-tune share the tensors that did not change between them.
#include <c10/core/GradMode.h>

#include "backend/backend.h"
#include "common/errors.h"

namespace skyrl_tx::backend {
namespace {

/// Adds each distinct storage of `tensors` once to `seen` (data pointer → bytes).
void count_storages(const std::vector<models::NamedParameter>& tensors, std::map<const void*, int64_t>& seen) {
  for (const auto& [name, tensor] : tensors) {
    if (!tensor.defined() || !tensor.has_storage()) continue;
    seen.emplace(tensor.storage().data(), static_cast<int64_t>(tensor.storage().nbytes()));
  }
}

/// A tensor that is its whole storage (not a view into a layer's stacked experts): one a new frozen model keeps as is.
bool standalone(const at::Tensor& t) {
  return t.has_storage() && t.storage_offset() == 0 && t.is_contiguous() &&
         t.storage().nbytes() == static_cast<size_t>(t.nbytes());
}

}  // namespace

std::map<std::string, std::pair<int64_t, int64_t>> Backend::weight_stamps(const std::string& model_id) const {
  auto full = full_models_.find(model_id);
  SKYRL_TX_CHECK(full != full_models_.end(), NotFound, "weight_stamps: full fine-tuning model '", model_id,
                 "' not found");
  const int64_t life = full_model_lives_.at(model_id);
  std::map<std::string, std::pair<int64_t, int64_t>> out;
  // Every in-place write (optim_step's foreach updates and copies back, set_trainable_state's copy_, ZeRO's
  // gathered ranges copied into views) bumps the tensor's version counter, views included.
  for (const auto& [name, tensor] : full->second->named_parameters()) out[name] = {life, tensor._version()};
  return out;
}

std::map<std::string, at::Tensor> Backend::shareable_frozen(const std::string& model_id) const {
  std::map<std::string, at::Tensor> out;
  auto full = full_models_.find(model_id);
  if (full == full_models_.end()) return out;
  const int64_t life = full_model_lives_.at(model_id);
  std::map<std::string, int64_t> now;
  for (const auto& [name, tensor] : full->second->named_parameters()) now[name] = tensor._version();
  for (const auto& [snapshot_id, origin] : frozen_origins_) {
    auto frozen = frozen_models_.find(snapshot_id);
    if (origin.life != life || frozen == frozen_models_.end()) continue;
    for (const auto& [name, tensor] : frozen->second->named_parameters()) {
      auto version = origin.versions.find(name);
      if (version != origin.versions.end() && now.count(name) && now[name] == version->second) {
        out.emplace(name, tensor);
      }
    }
  }
  return out;
}

void Backend::freeze_full_model(const std::string& model_id, const std::string& snapshot_id) {
  const models::CausalLM& live = *full_models_.at(model_id);
  std::map<std::string, at::Tensor> shared = shareable_frozen(model_id);
  FrozenOrigin origin{full_model_lives_.at(model_id), {}};
  models::WeightMap weights;  // a frozen device copy: later optim_steps must not change what it samples
  c10::NoGradGuard no_grad;
  for (const auto& [name, tensor] : live.named_parameters()) {
    origin.versions[name] = tensor._version();
    auto same = shared.find(name);
    // A stacked expert's frozen tensor is a view of its layer's stack: the new model would stack a copy of it.
    weights[name] = same != shared.end() && standalone(same->second) ? same->second : tensor.detach().clone();
  }
  add_frozen_model(snapshot_id, std::move(weights), /*parts=*/tensor_parallel().enabled(), /*adopt=*/true);
  frozen_origins_[snapshot_id] = std::move(origin);
}

int64_t Backend::frozen_bytes() const {
  std::map<const void*, int64_t> seen;
  for (const auto& [id, model] : frozen_models_) count_storages(model->named_parameters(), seen);
  int64_t bytes = 0;
  for (const auto& [ptr, n] : seen) bytes += n;
  return bytes;
}

int64_t Backend::snapshot_cost(const std::string& model_id) const {
  auto full = full_models_.find(model_id);
  if (full == full_models_.end()) return 0;  // an adapter's snapshot lives in host memory, not a frozen model
  const std::map<std::string, at::Tensor> shared = shareable_frozen(model_id);
  int64_t bytes = 0;
  for (const auto& [name, tensor] : full->second->named_parameters()) {
    auto same = shared.find(name);
    if (same == shared.end() || !standalone(same->second)) bytes += static_cast<int64_t>(tensor.nbytes());
  }
  return bytes;
}

std::pair<std::map<std::string, at::Tensor>, OptimizerState> Backend::state_views(const std::string& model_id) const {
  // Experts over the data-parallel ranks split LoRA expert factors too (split_group, not tensor_parallel): a rank's
  // views of those are its rows only, and trainable_state's gathers are collectives the other ranks must join.
  SKYRL_TX_CHECK(!tensor_parallel().enabled() && !split_group().enabled() && !zero_state(model_id), Unimplemented,
                 "state_views: model '", model_id,
                 "' is split over ranks here; copy it with trainable_state and optimizer_state");
  std::pair<std::map<std::string, at::Tensor>, OptimizerState> out;
  OptimizerState& opt = out.second;
  opt.kind = optimizer_kind(model_id);
  for (const optim::TrainableTensor& t : trainable_tensors(model_id)) out.first[t.name] = t.param.detach();
  if (auto d = dimuon_.find(model_id); d != dimuon_.end()) {
    opt.step = d->second.num_steps();
    for (const auto& [name, m] : d->second.momentum()) opt.momentum[name] = m.detach();
    return out;
  }
  auto it = optimizers_.find(model_id);
  if (it == optimizers_.end()) return out;
  opt.step = it->second.num_steps();
  for (const auto& [name, moments] : it->second.moments()) {
    opt.exp_avg[name] = moments.first.detach();
    opt.exp_avg_sq[name] = moments.second.detach();
  }
  for (const auto& [name, master] : it->second.masters()) opt.master[name] = master.detach();
  return out;
}

}  // namespace skyrl_tx::backend
