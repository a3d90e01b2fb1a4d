// Backend's sampling half: frozen adapter snapshots (LRU-resident in device slots) and the generators.
#include "backend/backend.h"

#include <set>

#include <c10/core/GradMode.h>

#include "common/errors.h"

namespace skyrl_tx::backend {
namespace {

// The base model's prefix-cache key: not a weights id (snapshot ids are never empty, nor start with a NUL).
const std::string kBasePrefixKey("\0base", 5);

}  // namespace

void Backend::set_tokenizer_info(std::vector<int64_t> eos_tokens, std::vector<std::string> token_bytes) {
  SKYRL_TX_CHECK(generators_.empty(), Conflict, "set_tokenizer_info: must be called before the first sample");
  eos_tokens_ = std::move(eos_tokens);
  token_bytes_ = std::make_shared<const sampling::TokenBytes>(std::move(token_bytes));
}

void Backend::snapshot_adapter(const std::string& adapter_id, const std::string& snapshot_id) {
  SKYRL_TX_CHECK(!snapshot_id.empty() && !snapshots_.count(snapshot_id) && !registry_.contains(snapshot_id) &&
                     !full_models_.count(snapshot_id) && !frozen_models_.count(snapshot_id),
                 Conflict, "snapshot: id '", snapshot_id, "' is empty or already in use");
  if (full_models_.count(adapter_id)) {
    freeze_full_model(adapter_id, snapshot_id);  // unchanged tensors shared with its earlier frozen copies
    return;
  }
  const int64_t slot = registry_.slot_of(adapter_id);
  SKYRL_TX_CHECK(slot != 0, InvalidArgument, "snapshot: name an adapter, not the base model");
  Snapshot snapshot;
  snapshot.config = registry_.config_of(adapter_id);
  c10::NoGradGuard no_grad;
  for (const auto& m : model_->lora_modules()) {
    if (!m.module->slot_enabled(slot)) continue;
    snapshot.factors[m.name] = {m.module->lora_a(slot).detach().to(at::kCPU, at::kFloat, false, true),
                                m.module->lora_b(slot).detach().to(at::kCPU, at::kFloat, false, true)};
  }
  snapshots_[snapshot_id] = std::move(snapshot);
}

void Backend::remove_snapshot(const std::string& snapshot_id) {
  if (auto frozen = frozen_models_.find(snapshot_id); frozen != frozen_models_.end()) {
    drop_generator(*frozen->second, "snapshot '" + snapshot_id +
                                        "' is serving running sample requests; remove it once they finish");
    frozen_models_.erase(frozen);
    frozen_origins_.erase(snapshot_id);  // its id may name other weights later
    return;
  }
  auto it = snapshots_.find(snapshot_id);
  SKYRL_TX_CHECK(it != snapshots_.end(), NotFound, "snapshot '", snapshot_id, "' not found");
  const int64_t slot = it->second.slot;
  if (slot >= 0) {
    SKYRL_TX_CHECK(!busy_slots().count(slot), Conflict, "snapshot '", snapshot_id,
                   "' is serving running sample requests; remove it once they finish");
    for (const auto& m : model_->lora_modules()) m.module->disable_slot(slot);
  }
  snapshots_.erase(it);
  // Its id may name other weights later: what was computed under it must not be served then.
  if (auto generator = generators_.find(model_.get()); generator != generators_.end()) {
    generator->second->drop_prefix_cache(snapshot_id);
  }
}

void Backend::drop_generator(const models::CausalLM& model, const std::string& busy_message) {
  auto generator = generators_.find(&model);
  if (generator == generators_.end()) return;
  SKYRL_TX_CHECK(generator->second->idle(), Conflict, busy_message);
  generators_.erase(generator);  // it refers to a model about to be freed
}

int64_t Backend::resident_slot(const std::string& snapshot_id) {
  Snapshot& snapshot = snapshots_.at(snapshot_id);
  snapshot.last_used = ++use_clock_;
  if (snapshot.slot >= 0) return snapshot.slot;
  // Pick a free snapshot slot, else evict the least recently used snapshot no running request needs.
  const int64_t first = config_.max_lora_adapters + 1, last = first + config_.max_resident_snapshots;
  std::set<int64_t> taken;
  for (const auto& [id, s] : snapshots_) if (s.slot >= 0) taken.insert(s.slot);
  const std::set<int64_t> busy = busy_slots();
  int64_t slot = -1;
  for (int64_t candidate = first; candidate < last && slot < 0; ++candidate) {
    if (!taken.count(candidate)) slot = candidate;
  }
  if (slot < 0) {
    Snapshot* victim = nullptr;
    for (auto& [id, s] : snapshots_) {
      if (s.slot >= 0 && !busy.count(s.slot) && (victim == nullptr || s.last_used < victim->last_used)) victim = &s;
    }
    SKYRL_TX_CHECK(victim != nullptr, ResourceExhausted, "sample: all ", config_.max_resident_snapshots,
                   " snapshot slots serve running requests; retry shortly or raise max_resident_snapshots");
    slot = victim->slot;
    victim->slot = -1;  // its factors stay in host memory; it becomes resident again on next use
  }
  const lora::LoraConfig& cfg = snapshot.config;
  for (const auto& m : model_->lora_modules()) {
    auto it = snapshot.factors.find(m.name);
    if (it == snapshot.factors.end()) {
      m.module->disable_slot(slot);
    } else {
      m.module->load_slot(slot, cfg.rank, cfg.scaling(), it->second.first, it->second.second);
    }
  }
  snapshot.slot = slot;
  return slot;
}

std::set<int64_t> Backend::busy_slots() const {
  auto it = generators_.find(model_.get());
  return it == generators_.end() ? std::set<int64_t>{} : it->second->slots_in_use();
}

sampling::Generator& Backend::generator_for(const models::CausalLM& model) {
  auto& generator = generators_[&model];
  if (!generator) {
    sampling::GeneratorConfig cfg;
    cfg.max_sequences = config_.max_sampling_sequences;
    cfg.max_length = std::min<int64_t>(config_.max_sampling_length, model.config().max_position_embeddings);
    cfg.prefill_token_budget = config_.train_micro_batch_tokens;
    cfg.seed = config_.seed;
    cfg.logprobs_chunk_tokens = config_.logprobs_chunk_tokens;
    cfg.max_logprobs_k = config_.max_logprobs_k;
    cfg.prefix_caching = config_.prefix_caching;
    cfg.packed_prefill = config_.sample_packed_prefill;
    // CPU decode stays eager: with no launch overhead to save, padding rows and keys would only add work.
    cfg.decode_mode = model.options().device.is_cuda() && config_.cuda_graphs && model.cuda_graph_capturable()
                          ? sampling::DecodeMode::kCudaGraph
                          : sampling::DecodeMode::kEager;
    generator = std::make_unique<sampling::Generator>(model, cfg, eos_tokens_, token_bytes_);
  }
  return *generator;
}

const models::CausalLM& Backend::sampling_model(const std::string& weights_id) const {
  if (auto full = full_models_.find(weights_id); full != full_models_.end()) return *full->second;
  if (auto frozen = frozen_models_.find(weights_id); frozen != frozen_models_.end()) return *frozen->second;
  if (!snapshots_.count(weights_id)) registry_.slot_of(weights_id);  // "" = base; unknown ids throw NotFound
  return *model_;
}

int64_t Backend::submit_sample(sampling::SampleRequest request) {
  const models::CausalLM* model = model_.get();
  int64_t slot = 0;
  const std::string id = request.weights_id;
  // Prompt prefixes are reused only under weights that never change: the base model, snapshots (adapter or full).
  std::string prefix_cache_key;
  if (auto full = full_models_.find(id); full != full_models_.end()) {
    model = full->second.get();
  } else if (auto frozen = frozen_models_.find(id); frozen != frozen_models_.end()) {
    model = frozen->second.get();
    prefix_cache_key = id;
  } else if (snapshots_.count(id)) {
    slot = resident_slot(id);
    prefix_cache_key = id;
  } else {
    slot = registry_.slot_of(id);  // "" = base (slot 0); unknown ids throw NotFound
    if (slot == 0) prefix_cache_key = kBasePrefixKey;
  }
  sampling::Generator& generator = generator_for(*model);
  const int64_t local = generator.submit(std::move(request), slot, std::move(prefix_cache_key));
  sample_ids_[{&generator, local}] = next_sample_id_;
  return next_sample_id_++;
}

std::map<int64_t, std::vector<std::vector<int64_t>>> Backend::sample_progress(
    const std::vector<int64_t>& sample_ids) const {
  const std::set<int64_t> wanted(sample_ids.begin(), sample_ids.end());
  std::map<int64_t, std::vector<std::vector<int64_t>>> out;
  for (const auto& [key, id] : sample_ids_) {
    if (!wanted.count(id)) continue;
    std::vector<std::vector<int64_t>> tokens = key.first->tokens_so_far(key.second);
    if (!tokens.empty()) out[id] = std::move(tokens);
  }
  return out;
}

std::vector<std::pair<int64_t, sampling::SampleResult>> Backend::sample_step() {
  std::vector<std::pair<int64_t, sampling::SampleResult>> finished = std::exchange(unclaimed_samples_, {});
  // The base model, then full models and frozen ones by id: not by address, so tensor-parallel ranks (whose models
  // live at different addresses) step them, and run their collectives, in the same order.
  std::vector<const models::CausalLM*> order{model_.get()};
  for (const auto& [id, model] : full_models_) order.push_back(model.get());
  for (const auto& [id, model] : frozen_models_) order.push_back(model.get());
  for (const models::CausalLM* model : order) {
    auto found = generators_.find(model);
    if (found == generators_.end() || found->second->idle()) continue;
    sampling::Generator* generator = found->second.get();
    for (auto& [local, result] : generator->step()) {
      auto it = sample_ids_.find({generator, local});
      finished.emplace_back(it->second, std::move(result));
      sample_ids_.erase(it);
    }
  }
  return finished;
}

bool Backend::sampling_idle() const {
  for (const auto& [model, generator] : generators_) {
    if (!generator->idle()) return false;
  }
  return true;
}

std::vector<sampling::SampleResult> Backend::sample(const std::vector<sampling::SampleRequest>& requests) {
  // Validate every request before queueing any, so a bad one never leaves orphaned work behind.
  for (const auto& request : requests) {
    sampling::SampleRequest copy = request;
    generator_for(sampling_model(request.weights_id)).validate(copy);
  }
  std::map<int64_t, size_t> index_of;
  std::vector<sampling::SampleResult> results(requests.size());
  size_t next = 0, done = 0;
  while (done < requests.size()) {
    // Submit what can be submitted; a snapshot that cannot be made resident yet waits for a step.
    for (; next < requests.size(); ++next) {
      try {
        index_of[submit_sample(requests[next])] = next;
      } catch (const ResourceExhausted&) {
        if (sampling_idle()) throw;
        break;
      }
    }
    for (auto& [id, result] : sample_step()) {
      auto it = index_of.find(id);
      if (it == index_of.end()) {  // a request of the continuous API: hand it to the next sample_step
        unclaimed_samples_.emplace_back(id, std::move(result));
        continue;
      }
      results[it->second] = std::move(result);
      ++done;
    }
  }
  return results;
}

}  // namespace skyrl_tx::backend
