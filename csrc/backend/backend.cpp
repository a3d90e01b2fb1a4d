// Backend: the facade Python drives: one base model, its adapter slots, and batched logprob computation.
#include "backend/backend.h"

#include <c10/core/GradMode.h>

#include <ATen/CPUGeneratorImpl.h>

#include <set>

#include "batching/packing.h"
#include "common/dtype.h"
#include "common/errors.h"
#include "common/host_memory.h"
#include "loss/token_logprobs.h"
#include "sampling/kv_budget.h"

namespace skyrl_tx::backend {

bool targets_group(const lora::LoraConfig& c, models::LoraGroup group) {
  switch (group) {
    case models::LoraGroup::kAttention: return c.train_attn;
    case models::LoraGroup::kMlp: return c.train_mlp;
    case models::LoraGroup::kUnembed: return c.train_unembed;
  }
  return false;
}

void BackendConfig::validate() const {
  SKYRL_TX_CHECK(max_lora_adapters >= 1, InvalidArgument, "backend config: max_lora_adapters must be >= 1 (got ",
                 max_lora_adapters, ")");
  SKYRL_TX_CHECK(max_lora_rank >= 1, InvalidArgument, "backend config: max_lora_rank must be >= 1 (got ",
                 max_lora_rank, ")");
  SKYRL_TX_CHECK(logprobs_chunk_tokens >= 1, InvalidArgument,
                 "backend config: logprobs_chunk_tokens must be >= 1 (got ", logprobs_chunk_tokens, ")");
  SKYRL_TX_CHECK(max_sampling_sequences >= 1 && max_sampling_length >= 2 && max_resident_snapshots >= 1,
                 InvalidArgument, "backend config: max_sampling_sequences >= 1, max_sampling_length >= 2 and ",
                 "max_resident_snapshots >= 1 are required");
  SKYRL_TX_CHECK(max_logprobs_k >= 1, InvalidArgument, "backend config: max_logprobs_k must be >= 1 (got ",
                 max_logprobs_k, ")");
  SKYRL_TX_CHECK(max_full_models >= 0, InvalidArgument, "backend config: max_full_models must be >= 0 (got ",
                 max_full_models, ")");
  SKYRL_TX_CHECK(train_micro_batch_tokens >= 1, InvalidArgument,
                 "backend config: train_micro_batch_tokens must be >= 1 (got ", train_micro_batch_tokens, ")");
  SKYRL_TX_CHECK(train_micro_batch_size >= 0, InvalidArgument,
                 "backend config: train_micro_batch_size must be >= 0 (0: no limit besides train_micro_batch_tokens; "
                 "got ", train_micro_batch_size, ")");
  SKYRL_TX_CHECK(gpu_memory_utilization >= 0.0 && gpu_memory_utilization <= 1.0, InvalidArgument,
                 "backend config: gpu_memory_utilization must be in [0, 1] (0: max_sampling_sequences rows; got ",
                 gpu_memory_utilization, ")");
  SKYRL_TX_CHECK(zero_bucket_mb >= 1, InvalidArgument, "backend config: zero_bucket_mb must be >= 1 (got ",
                 zero_bucket_mb, ")");
  parse_dtype(dtype);
  parse_device(device);
  models::parse_grouped_expert_gemm(grouped_expert_gemm);
}

Backend::Backend(const models::ModelConfig& model_config, const BackendConfig& config, models::WeightMap weights,
                 std::shared_ptr<dist::Collectives> tensor_parallel,
                 std::shared_ptr<dist::Collectives> expert_parallel)
    : config_(config), registry_(config.max_lora_adapters) {
  config_.validate();
  models::ModelOptions options;
  // Slots: 0 = base, 1..max_lora_adapters = live adapters, then the resident snapshot slots.
  options.num_slots = config.max_lora_adapters + 1 + config.max_resident_snapshots;
  options.max_rank = config.max_lora_rank;
  options.dtype = parse_dtype(config.dtype);
  options.device = parse_device(config.device);
  if (options.device.is_cpu()) keep_freed_host_memory();  // the CPU's activations reuse last step's pages
  options.tensor_parallel = dist::TensorParallel(std::move(tensor_parallel));
  if (expert_parallel && config.expert_parallel_size > 1) {  // spread over the data-parallel ranks
    SKYRL_TX_CHECK(!options.tensor_parallel.enabled() && config.expert_parallel_size == expert_parallel->world_size(),
                   InvalidArgument, "backend config: expert_parallel_size ", config.expert_parallel_size,
                   " over the data-parallel ranks must equal their number (", expert_parallel->world_size(),
                   ") with tensor_parallel_size 1 (got ", options.tensor_parallel.size(), ")");
    options.experts_over_data_parallel = std::move(expert_parallel);
  } else {
    SKYRL_TX_CHECK(config.expert_parallel_size == 1 || config.expert_parallel_size == options.tensor_parallel.size(),
                   InvalidArgument, "backend config: expert_parallel_size ", config.expert_parallel_size,
                   " must be 1, tensor_parallel_size (", options.tensor_parallel.size(), ") or, with "
                   "tensor_parallel_size 1, the number of data-parallel ranks");
  }
  options.split_experts = config.expert_parallel_size > 1;
  options.grouped_expert_gemm = models::parse_grouped_expert_gemm(config.grouped_expert_gemm);
  model_ = std::make_unique<models::CausalLM>(model_config, std::move(weights), options);
  if (config_.gpu_memory_utilization > 0.0) size_kv_cache_from_memory();
}

void Backend::size_kv_cache_from_memory() {
  const int64_t max_len = std::min<int64_t>(config_.max_sampling_length, model_->config().max_position_embeddings);
  const int64_t row_bytes =
      sampling::kv_cache_row_bytes(model_->config(), max_len, model_->options().dtype, tensor_parallel().size());
  int64_t rows = sampling::kv_rows_within_device_memory(model_->options().device, config_.gpu_memory_utilization,
                                                        row_bytes);
  if (tensor_parallel().enabled()) {  // every rank decodes the same rows: the fewest any rank has room for
    // [1], on the device: an NCCL group reduces device tensors only
    at::Tensor fewest = tensor_parallel().max(
        at::full({1}, -rows, at::TensorOptions().dtype(at::kLong).device(model_->options().device)));
    rows = -fewest.item<int64_t>();
  }
  config_.max_sampling_sequences = rows;
}

int64_t Backend::create_adapter(const std::string& adapter_id, const lora::LoraConfig& lora_config) {
  lora_config.validate(config_.max_lora_rank);
  SKYRL_TX_CHECK(!full_models_.count(adapter_id), Conflict, "create_model: model '", adapter_id, "' already exists");
  const int64_t slot = registry_.allocate(adapter_id, lora_config);
  // One generator per adapter, consumed in module order: the same seed gives the same adapter.
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(lora_config.seed);
  for (const auto& m : model_->lora_modules()) {
    if (!targets_group(lora_config, m.group)) continue;
    if (m.split == dist::TpSplit::kRow) {  // A holds this rank's input columns: drawn whole, then cut
      const int64_t in = m.module->in_features();
      m.module->enable_slot(slot, lora_config.rank, lora_config.scaling(), generator, in * tensor_parallel().size(),
                            in * tensor_parallel().rank());
    } else if (m.split == dist::TpSplit::kOwned) {  // drawn whole everywhere, kept by the expert's rank only
      m.module->enable_slot(slot, lora_config.rank, lora_config.scaling(), generator, m.whole_in, 0);
    } else {
      m.module->enable_slot(slot, lora_config.rank, lora_config.scaling(), generator);
    }
  }
  return slot;
}

void Backend::remove_adapter(const std::string& adapter_id) {
  SKYRL_TX_CHECK(!busy_slots().count(registry_.slot_of(adapter_id)), Conflict, "unload_model: model '", adapter_id,
                 "' is serving running sample requests; unload it once they finish");
  const int64_t slot = registry_.release(adapter_id);
  for (const auto& m : model_->lora_modules()) m.module->disable_slot(slot);
  optimizers_.erase(adapter_id);
  dimuon_.erase(adapter_id);
}

void Backend::set_adapter_weights(const std::string& adapter_id, const std::map<std::string, at::Tensor>& weights) {
  const int64_t slot = registry_.slot_of(adapter_id);
  SKYRL_TX_CHECK(slot != 0, InvalidArgument, "set_adapter_weights: name an adapter, not the base model");
  // Check every name and shape before copying anything, so a bad file never half-overwrites an adapter.
  std::vector<std::pair<lora::LoraLinear*, std::pair<at::Tensor, at::Tensor>>> updates;
  std::set<std::string> unused;
  for (const auto& [name, tensor] : weights) unused.insert(name);
  for (const auto& m : model_->lora_modules()) {
    if (!m.module->slot_enabled(slot)) continue;
    const std::string a_name = m.name + ".lora_A.weight", b_name = m.name + ".lora_B.weight";
    auto a = weights.find(a_name), b = weights.find(b_name);
    SKYRL_TX_CHECK(a != weights.end() && b != weights.end(), InvalidArgument, "set_adapter_weights: adapter '",
                   adapter_id, "' targets ", m.name, " but ", a_name, " / ", b_name, " are missing");
    // Whole factors, as one process holds them; under tensor parallelism this rank keeps its part.
    const optim::TrainableTensor factor_a = lora_factor(m, slot, false), factor_b = lora_factor(m, slot, true);
    const std::vector<int64_t> shape_a = whole_shape(factor_a), shape_b = whole_shape(factor_b);
    SKYRL_TX_CHECK(a->second.sizes() == at::IntArrayRef(shape_a) && b->second.sizes() == at::IntArrayRef(shape_b),
                   InvalidArgument, "set_adapter_weights: ", m.name, " expects lora_A ", at::IntArrayRef(shape_a),
                   " and lora_B ", at::IntArrayRef(shape_b), ", got ", a->second.sizes(), " and ",
                   b->second.sizes());
    updates.push_back({m.module, {part(factor_a, a->second), part(factor_b, b->second)}});
    unused.erase(a_name);
    unused.erase(b_name);
  }
  SKYRL_TX_CHECK(unused.empty(), InvalidArgument, "set_adapter_weights: unexpected tensor '", *unused.begin(),
                 "' (not a LoRA factor of a module this adapter targets)");
  for (auto& [module, factors] : updates) module->set_factors(slot, factors.first, factors.second);
}

std::map<std::string, at::Tensor> Backend::get_adapter_weights(const std::string& adapter_id) const {
  const int64_t slot = registry_.slot_of(adapter_id);
  std::map<std::string, at::Tensor> out;
  for (const auto& m : model_->lora_modules()) {
    if (!m.module->slot_enabled(slot)) continue;
    for (const bool b : {false, true}) {
      const optim::TrainableTensor factor = lora_factor(m, slot, b);
      out[factor.name] = whole(factor, factor.param).to(at::kCPU, at::kFloat, false, true);
    }
  }
  return out;
}

std::vector<std::string> Backend::adapter_module_names(const std::string& adapter_id) const {
  const int64_t slot = registry_.slot_of(adapter_id);
  std::vector<std::string> names;
  for (const auto& m : model_->lora_modules()) {
    if (slot != 0 && m.module->slot_enabled(slot)) names.push_back(m.name);
  }
  return names;
}

std::vector<at::Tensor> Backend::token_logprobs(const std::vector<at::Tensor>& input_tokens,
                                                const std::vector<at::Tensor>& target_tokens,
                                                const std::vector<std::string>& adapter_ids) const {
  std::vector<int64_t> slots;
  slots.reserve(adapter_ids.size());
  for (const auto& id : adapter_ids) slots.push_back(registry_.slot_of(id));
  c10::NoGradGuard no_grad;
  const auto& options = model_->options();
  batching::PackedBatch batch =
      batching::pack_sequences(input_tokens, target_tokens, slots, model_config().vocab_size, options.device,
                               training_layout());
  at::Tensor hidden = model_->hidden_states(batch.input_ids, batch.positions, batch.mask, batch.segments);
  at::Tensor logprobs = loss::token_logprobs(model_->output_head(), hidden, batch.target_ids.reshape({-1}),
                                             batch.segments, config_.logprobs_chunk_tokens);  // [B * T]
  std::vector<at::Tensor> out;
  for (at::Tensor& t : batching::unpack_tokens(logprobs.to(at::kCPU), batch)) out.push_back(t.clone());
  return out;
}

}  // namespace skyrl_tx::backend
