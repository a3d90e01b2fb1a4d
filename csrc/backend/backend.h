// Backend: the facade Python drives: one base model, its adapter slots, and batched logprob computation.
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend_config.h"
#include "backend/micro_batch.h"
#include "batching/train_batch.h"
#include "dist/collectives.h"
#include "lora/adapter_registry.h"
#include "models/causal_lm.h"
#include "optim/adamw.h"
#include "optim/dimuon.h"
#include "optim/zero_adamw.h"
#include "sampling/generator.h"

namespace skyrl_tx::backend {

/// NOTE: single owner — only the engine thread calls a Backend, so it holds no locks.
/// Whether an adapter with config `c` adapts the modules of `group`.
bool targets_group(const lora::LoraConfig& c, models::LoraGroup group);

/// Optimizer state in checkpoint form (float32 CPU tensors keyed by trainable-tensor name): AdamW's moments
/// (exp_avg, exp_avg_sq) or Dimuon's momentum, as `kind` says; and AdamW's float32 master weights of the tensors
/// stored below float32 (a bfloat16 full fine-tune's weights; none for float32 ones, LoRA factors included).
struct OptimizerState {
  std::string kind = "adamw";  // "adamw" | "dimuon"
  int64_t step = 0;
  std::map<std::string, at::Tensor> exp_avg;
  std::map<std::string, at::Tensor> exp_avg_sq;
  std::map<std::string, at::Tensor> momentum;
  std::map<std::string, at::Tensor> master;
};

class Backend {
 public:
  /// weights: HF-named tensors of every shard. Throws InvalidArgument / Unimplemented for bad configs.
  /// tensor_parallel: this rank's tensor-parallel group (null: none). Its ranks hold their shard of every split
  /// weight (models/causal_lm.h) and make every call together with the same arguments; LoRA factors, gradients
  /// and optimizer moments cross this interface whole (gathered on the way out, sharded on the way in), so
  /// checkpoints load into any layout.
  Backend(const models::ModelConfig& model_config, const BackendConfig& config, models::WeightMap weights,
          std::shared_ptr<dist::Collectives> tensor_parallel = nullptr,
          std::shared_ptr<dist::Collectives> expert_parallel = nullptr);

  /// Allocates a slot and initialises the adapter (A random from config.seed, B = 0). Returns the slot.
  /// Throws InvalidArgument (bad rank/alpha), Conflict (id exists), ResourceExhausted (no free slot).
  int64_t create_adapter(const std::string& adapter_id, const lora::LoraConfig& lora_config);
  /// Frees the slot and zeroes its factors and gradients. Throws NotFound.
  void remove_adapter(const std::string& adapter_id);
  /// Overwrites an adapter's factors from PEFT-style names "<module>.lora_A.weight" / ".lora_B.weight"
  /// (module = HF path, e.g. "model.layers.0.self_attn.q_proj"). Unknown or missing names are errors.
  void set_adapter_weights(const std::string& adapter_id, const std::map<std::string, at::Tensor>& weights);
  /// The adapter's factors under the same names, as float32 CPU copies.
  std::map<std::string, at::Tensor> get_adapter_weights(const std::string& adapter_id) const;

  /// Per-token log p(target_i | input_0..i) for each sequence, under its adapter ("" = base model).
  /// Returns one float32 CPU tensor of the sequence's length per request. No autograd, no side effects.
  std::vector<at::Tensor> token_logprobs(const std::vector<at::Tensor>& input_tokens,
                                         const std::vector<at::Tensor>& target_tokens,
                                         const std::vector<std::string>& adapter_ids) const;

  // ---- training (backend_training.cpp) ----
  /// Full fine-tuning (the SDK's lora_rank = 0): a private trainable copy of every base tensor; the
  /// shared base that LoRA tenants use never changes. Throws Conflict, ResourceExhausted.
  void create_full_model(const std::string& model_id);
  /// Removes a LoRA adapter or a full model, with its gradients and optimizer state. Throws NotFound.
  void remove_model(const std::string& model_id);
  /// One pass over requests of any models and losses, split into token-budgeted micro-batches;
  /// gradients accumulate per model until optim_step. Throws InvalidArgument / NotFound before any compute.
  /// All-or-nothing: if a micro-batch fails while computing (out of memory, a device error), the error
  /// propagates and every model's accumulated gradients are exactly as before the call.
  std::vector<batching::TrainResult> forward_backward(const std::vector<batching::TrainRequest>& requests);
  /// Same outputs as forward_backward, without gradients or any other side effect.
  std::vector<batching::TrainResult> forward(const std::vector<batching::TrainRequest>& requests);
  /// Data parallelism: from now on every rank of `group` makes the same calls with the same requests; each
  /// computes its share of the rows (split by tokens), and all end with the same results and the gradients summed
  /// over the ranks, as one process would have them (backend/data_parallel.h). nullptr: one process again.
  /// Full fine-tunes are then ZeRO-sharded (optim/zero_adamw.h): each rank keeps its range of the summed gradients
  /// and of the AdamW moments, and optim_step, optimizer_state and trainable_grads of a full model become
  /// collective (every rank calls them together). Existing full models' moments are sliced into their ranges.
  void attach_collectives(std::shared_ptr<dist::Collectives> group);
  /// AdamW on one model's accumulated gradients, then frees them (read back as zeros). Returns grad_norm,
  /// learning_rate, step.
  std::map<std::string, double> optim_step(const std::string& model_id, const optim::AdamParams& params);
  /// Dimuon on a model created with it (set_optimizer_kind); InvalidArgument for an AdamW model (and
  /// AdamParams sent to a Dimuon model).
  std::map<std::string, double> optim_step(const std::string& model_id, const optim::DimuonParams& params);
  /// Chooses a model's optimizer ("adamw", the default, or "dimuon") right after creating it; fixed for its
  /// life (Conflict once it has stepped with another). Dimuon is for LoRA models only (InvalidArgument).
  void set_optimizer_kind(const std::string& model_id, const std::string& kind);
  std::string optimizer_kind(const std::string& model_id) const;
  /// The model's trainable tensors (LoRA factors by "<module>.lora_A.weight", or HF names for full
  /// fine-tuning) and their accumulated gradients (zeros if none), as float32 CPU copies.
  std::map<std::string, at::Tensor> trainable_state(const std::string& model_id) const;
  /// trainable_state of the tensors named in `names` only (all when empty), as float32 or (model_dtype) in the
  /// dtype the model holds them in: what a full fine-tune's snapshot spill writes.
  std::map<std::string, at::Tensor> trainable_state(const std::string& model_id, const std::set<std::string>& names,
                                                    bool model_dtype) const;
  std::map<std::string, at::Tensor> trainable_grads(const std::string& model_id) const;
  /// Bytes of optimizer state (moments, momentum, float32 master weights of bfloat16 weights) and pending gradients
  /// this rank holds for the model: a ZeRO full fine-tune holds about 1/world_size of one process's.
  int64_t optimizer_state_bytes(const std::string& model_id) const;

  // ---- checkpoint state (backend_state.cpp) ----
  /// Optimizer state of a model as float32 CPU copies: step 0 and no moments before its first optim_step.
  OptimizerState optimizer_state(const std::string& model_id) const;
  /// Restores state saved by optimizer_state. Its kind must be the model's optimizer, names and shapes must
  /// match the model's trainable tensors (InvalidArgument names the first mismatch); nothing changes on error.
  /// Master weights: none (a state saved from float32 weights or before they existed) = rebuilt from the current
  /// weights at the next step; else one per bfloat16 tensor, each rounding to the model's current weight (load the
  /// weights first: InvalidArgument otherwise). Masters of tensors the model holds in float32 are ignored.
  void set_optimizer_state(const std::string& model_id, const OptimizerState& state);
  /// Overwrites a model's trainable tensors: LoRA factors (as set_adapter_weights) or, for a full model,
  /// every HF-named parameter (its AdamW master weights are then rebuilt from them at the next step). All names
  /// and shapes are checked before anything is copied.
  void set_trainable_state(const std::string& model_id, const std::map<std::string, at::Tensor>& weights);
  /// A frozen snapshot from saved factors ("<module>.lora_A.weight" / ".lora_B.weight") without using a
  /// live slot: how a sampler checkpoint on disk becomes sampleable. Throws Conflict, InvalidArgument.
  void load_snapshot(const std::string& snapshot_id, const lora::LoraConfig& lora_config,
                     const std::map<std::string, at::Tensor>& weights);
  /// A frozen full model for sampling (a full fine-tuning snapshot or a full sampler checkpoint).
  void load_frozen_model(const std::string& snapshot_id, models::WeightMap weights);
  /// A frozen full model's weights (HF names, CPU copies in the model's dtype): what load_frozen_model takes, for
  /// catching a replaced sampler engine up. Throws NotFound.
  std::map<std::string, at::Tensor> frozen_model_weights(const std::string& snapshot_id) const;
  /// Views of a model's live trainable tensors and optimizer state (no copies; PEFT/HF names as trainable_state,
  /// core names as optimizer_state): a recovery snapshot copies them to host memory off the engine thread while
  /// nothing steps the model. Unimplemented when they are not whole here (tensor parallelism, ZeRO shards).
  std::pair<std::map<std::string, at::Tensor>, OptimizerState> state_views(const std::string& model_id) const;

  // ---- frozen full models share unchanged tensors (backend_frozen.cpp) ----
  /// Per tensor of full model `model_id`, its stamp (life of the model, the tensor's version counter): equal
  /// stamps mean equal contents, so a snapshot spill writes a tensor only when its stamp is new.
  std::map<std::string, std::pair<int64_t, int64_t>> weight_stamps(const std::string& model_id) const;
  /// Bytes held by the frozen full models, each tensor counted once however many snapshots share it.
  int64_t frozen_bytes() const;
  /// Bytes a snapshot of full model `model_id` would add now: its tensors changed since every frozen copy of it.
  int64_t snapshot_cost(const std::string& model_id) const;

  // ---- sampling (backend_sampling.cpp) ----
  /// Tokenizer facts for generation: EOS ids (stop by default) and every token's bytes (stop strings).
  void set_tokenizer_info(std::vector<int64_t> eos_tokens, std::vector<std::string> token_bytes);
  /// Freezes a model's current weights as `snapshot_id` (adapter factors in host memory; a full model as a
  /// frozen device copy): sampling from the snapshot
  /// is unaffected by later training. Throws NotFound, Conflict (id taken).
  void snapshot_adapter(const std::string& adapter_id, const std::string& snapshot_id);
  void remove_snapshot(const std::string& snapshot_id);
  bool has_snapshot(const std::string& snapshot_id) const {
    return snapshots_.count(snapshot_id) > 0 || frozen_models_.count(snapshot_id) > 0;
  }
  /// Queues a request (weights_id: "" base, live adapter, full model or snapshot). Returns its id.
  /// Throws InvalidArgument / NotFound; ResourceExhausted when every snapshot slot serves running requests.
  int64_t submit_sample(sampling::SampleRequest request);
  /// Advances every queued and running request by one token; returns the finished ones by id.
  std::vector<std::pair<int64_t, sampling::SampleResult>> sample_step();
  /// Streaming: for each of `sample_ids` still decoding, the tokens each of its samples has so far.
  std::map<int64_t, std::vector<std::vector<int64_t>>> sample_progress(const std::vector<int64_t>& sample_ids) const;
  bool sampling_idle() const;
  /// Blocking convenience: runs `requests` to completion (alongside anything already running).
  std::vector<sampling::SampleResult> sample(const std::vector<sampling::SampleRequest>& requests);

  const models::ModelConfig& model_config() const { return model_->config(); }
  const BackendConfig& config() const { return config_; }
  /// KV-cache rows (sequences decoding at once): the configured ones, or what gpu_memory_utilization left room for.
  int64_t max_sampling_sequences() const { return config_.max_sampling_sequences; }
  std::vector<std::string> adapter_module_names(const std::string& adapter_id) const;

 private:
  /// gpu_memory_utilization: sets max_sampling_sequences to the KV-cache rows that fit (before any cache exists).
  void size_kv_cache_from_memory();
  std::shared_ptr<dist::Collectives> collectives_;  // set: data-parallel rank (attach_collectives)
  const dist::TensorParallel& tensor_parallel() const { return model_->tensor_parallel(); }
  /// The group trainable tensors are split over: the tensor-parallel one, or the data-parallel one when the
  /// experts are spread over it (only experts are split then: they are owned by one rank each).
  const dist::TensorParallel& split_group() const {
    return experts_over_data_parallel() ? model_->expert_parallel().group() : tensor_parallel();
  }
  bool experts_over_data_parallel() const { return model_->expert_parallel().over_data_parallel(); }
  /// Under tensor parallelism each carries how the group holds it (optim::TrainableTensor::split).
  std::vector<optim::TrainableTensor> trainable_tensors(const std::string& model_id) const;
  /// `local` (this rank's part of `t`, or of a tensor shaped like it: a gradient, a moment) as one process has it.
  at::Tensor whole(const optim::TrainableTensor& t, const at::Tensor& local) const;
  /// This rank's part of `full`, a tensor shaped like `t` in one process.
  at::Tensor part(const optim::TrainableTensor& t, const at::Tensor& full) const;
  /// The shape `t` has in one process.
  std::vector<int64_t> whole_shape(const optim::TrainableTensor& t) const;
  /// A LoRA factor of `slot` in module `m` (B when `b`), named and with its split (backend_tensor_parallel.cpp).
  optim::TrainableTensor lora_factor(const models::NamedLoraModule& m, int64_t slot, bool b) const;
  /// How the group holds module `m`'s factor (B when `b`) whose local shape is `local`.
  dist::TensorSplit lora_split(const models::NamedLoraModule& m, bool b, at::IntArrayRef local) const;
  /// What optim_step updates: trainable_tensors less buffers (DeepSeek's router score bias).
  std::vector<optim::TrainableTensor> stepped_tensors(const std::string& model_id) const;
  bool data_parallel() const { return collectives_ && collectives_->world_size() > 1; }
  /// How training micro-batches lay out their sequences (train_packed_sequences).
  batching::RowLayout training_layout() const {
    return config_.train_packed_sequences ? batching::RowLayout::kPacked : batching::RowLayout::kPadded;
  }
  int64_t zero_bucket_elements() const { return config_.zero_bucket_mb * (int64_t(1) << 20) / 4; }  // float32
  /// A full model's ZeRO state, or nullptr when it is not sharded (one process).
  optim::ZeroAdamState* zero_state(const std::string& model_id);
  const optim::ZeroAdamState* zero_state(const std::string& model_id) const;
  std::vector<batching::TrainResult> run_requests(const std::vector<batching::TrainRequest>& requests, bool train);
  /// Experts over the data-parallel ranks: how many micro-batches fewer than the busiest rank's this rank planned
  /// (a collective), and one padding micro-batch of those (backend_training.cpp).
  int64_t micro_batches_short_of_busiest(size_t planned) const;
  void run_padding_micro_batch(const MicroBatchOptions& options);

  BackendConfig config_;
  std::unique_ptr<models::CausalLM> model_;  // the shared base; LoRA adapters live in its slots
  lora::AdapterRegistry registry_;
  std::map<std::string, std::unique_ptr<models::CausalLM>> full_models_;
  std::map<std::string, std::unique_ptr<models::CausalLM>> frozen_models_;  // full-model snapshots (no grads)
  std::map<std::string, optim::AdamState> optimizers_;  // one per AdamW model id (ZeRO full models: below)
  std::map<std::string, optim::ZeroAdamState> zero_optimizers_;  // one per full model while data parallel
  std::map<std::string, optim::DimuonState> dimuon_;    // one per Dimuon model id (its presence = the kind)
  void free_grads(const std::string& model_id);
  /// A frozen model from whole weights, or from this rank's parts (`parts`: a snapshot of a split full fine-tune).
  /// adopt: the weights are private device tensors in the model's dtype (clones, or tensors another frozen copy
  /// shares): kept as they are instead of copied.
  void add_frozen_model(const std::string& snapshot_id, models::WeightMap weights, bool parts, bool adopt = false);
  /// A frozen copy of full model `model_id`: tensors unchanged since a frozen copy of it still held are shared with
  /// that copy (same storage), the others cloned (backend_frozen.cpp).
  void freeze_full_model(const std::string& model_id, const std::string& snapshot_id);
  /// Frozen tensors of `model_id`'s current life whose content equals its live tensor's now (stamp unchanged).
  std::map<std::string, at::Tensor> shareable_frozen(const std::string& model_id) const;
  struct FrozenOrigin {
    int64_t life = 0;                        // the full model's life (full_model_lives_) it was frozen from
    std::map<std::string, int64_t> versions;  // tensor → its version counter when frozen
  };
  std::map<std::string, FrozenOrigin> frozen_origins_;  // snapshot id → what it is a copy of (snapshot_adapter only)
  std::map<std::string, int64_t> full_model_lives_;      // full model id → a number no other life of any model had
  int64_t next_life_ = 1;

  struct Snapshot {
    lora::LoraConfig config;
    std::map<std::string, std::pair<at::Tensor, at::Tensor>> factors;  // module → (A, B), host float32
    int64_t slot = -1;                                                 // device slot when resident
    uint64_t last_used = 0;
  };
  int64_t resident_slot(const std::string& snapshot_id);
  sampling::Generator& generator_for(const models::CausalLM& model);
  /// Forgets the generator of a model about to be freed; Conflict (busy_message) while it has running samples.
  void drop_generator(const models::CausalLM& model, const std::string& busy_message);
  std::set<int64_t> busy_slots() const;
  /// The model a sample request's weights_id runs on (NotFound for unknown ids); no side effects.
  const models::CausalLM& sampling_model(const std::string& weights_id) const;  // base-model slots that queued or running samples need
  std::map<std::string, Snapshot> snapshots_;
  uint64_t use_clock_ = 0;
  std::vector<int64_t> eos_tokens_;
  std::shared_ptr<const sampling::TokenBytes> token_bytes_;
  std::map<const models::CausalLM*, std::unique_ptr<sampling::Generator>> generators_;
  std::map<std::pair<const sampling::Generator*, int64_t>, int64_t> sample_ids_;  // (generator, local) → id
  int64_t next_sample_id_ = 1;
  std::vector<std::pair<int64_t, sampling::SampleResult>> unclaimed_samples_;
};

}  // namespace skyrl_tx::backend
