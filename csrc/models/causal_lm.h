// CausalLM: the shared decoder stack (every registered architecture): embed → layers → final norm → lm_head (LoRA-capable).
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dist/tensor_parallel.h"
#include "loss/token_logprobs.h"
#include "models/layers.h"
#include "models/rope.h"

namespace skyrl_tx::models {

struct ModelOptions {
  int64_t num_slots = 2;  // adapter slots including slot 0 (base)
  int64_t max_rank = 32;
  at::ScalarType dtype = at::kFloat;
  at::Device device = at::kCPU;
  /// Heads, MLP columns and the vocabulary split over this group (dense GQA models; size 1: not split).
  dist::TensorParallel tensor_parallel;
  /// The weights given are already this rank's parts (a copy of a split model: a full fine-tune, a snapshot).
  bool weights_are_parts = false;
  /// The weights given are private tensors already on the device in the model's dtype (a frozen copy's clones, or
  /// tensors it shares with another frozen copy): kept as they are, not copied.
  bool adopt_weights = false;
  /// Expert parallelism: each rank holds and runs its share of every MoE layer's experts (the rest of the MoE
  /// layer stays replicated), over the tensor-parallel group ...
  bool split_experts = false;
  /// ... or, when set, over this data-parallel group (tensor_parallel then of size 1; dist/expert_parallel.h).
  std::shared_ptr<dist::Collectives> experts_over_data_parallel;
  /// How MoE layers run their experts: grouped GEMMs over stacked weights, or one matmul chain per expert.
  GroupedExpertGemm grouped_expert_gemm = GroupedExpertGemm::kAuto;
};

class CausalLM {
 public:
  /// Builds the model from HF-named weights. Throws InvalidArgument listing missing/unexpected keys.
  CausalLM(const ModelConfig& config, WeightMap weights, const ModelOptions& options);
  CausalLM(CausalLM&&) = delete;  // the MoE layers point at expert_parallel_

  /// input_ids, positions: int64 [B, T]; rows sorted so `segments` are contiguous per adapter.
  /// Returns final-norm hidden states [B * T, hidden] in the compute dtype. `cache`: generation only.
  at::Tensor hidden_states(const at::Tensor& input_ids, const at::Tensor& positions, const AttentionMask& mask,
                           const lora::AdapterSegments& segments, const KvCacheView* cache = nullptr) const;

  // Pieces of hidden_states, for the training driver's activation checkpointing (layer by layer).
  at::Tensor embed(const at::Tensor& input_ids) const;  // [B, T] → [B, T, hidden]
  std::pair<at::Tensor, at::Tensor> rope(const at::Tensor& positions, at::ScalarType dtype) const;
  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  at::Tensor layer_forward(int64_t layer, const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin,
                           const AttentionMask& mask, const lora::AdapterSegments& segments,
                           const KvCacheView* cache = nullptr) const;
  at::Tensor final_norm(const at::Tensor& h) const;  // [B, T, hidden] → [B * T, hidden]

  const lora::LoraLinear& lm_head() const { return *lm_head_; }
  /// What target logprobs are read through (loss/token_logprobs.h): the lm_head and its vocabulary rows.
  loss::OutputHead output_head() const { return {*lm_head_, options_.tensor_parallel, vocab_shard_}; }
  /// hidden [N, hidden] → logits [N, vocab] over the whole vocabulary (gathered from every tensor-parallel rank;
  /// sampling only, so no gradient under tensor parallelism).
  at::Tensor logits(const at::Tensor& hidden, const lora::AdapterSegments& segments) const;
  const dist::TensorParallel& tensor_parallel() const { return options_.tensor_parallel; }
  /// The group the MoE experts are spread over (disabled: every rank holds every expert).
  const dist::ExpertParallel& expert_parallel() const { return expert_parallel_; }
  /// The KV heads this rank caches (its share under tensor parallelism).
  int64_t local_kv_heads() const { return config_.cache_kv_heads_per_rank(options_.tensor_parallel.size()); }
  /// Every base tensor by HF name (lm_head.weight omitted when tied): what full fine-tuning trains and saves.
  /// Under tensor parallelism a split tensor is this rank's part (parameter_split says which).
  std::vector<NamedParameter> named_parameters() const;
  /// Tensor parallelism: how the group holds `name` (replicated unless split or owned by one rank).
  dist::TensorSplit parameter_split(const std::string& name) const;
  /// Tensor parallelism: a replicated tensor whose gradient is this rank's share only (the per-head q/k norms see
  /// only this rank's heads), summed over the group after each batch.
  bool partial_gradient(const std::string& name) const;
  /// Every LoRA-capable linear with its HF module path and target group (stable order).
  const std::vector<NamedLoraModule>& lora_modules() const { return lora_modules_; }
  /// Every LoRA module's row-dense inference factors brought up to date (see LoraLinear::prepare_inference):
  /// a CUDA graph of the row-dense path reads them without running the code that refreshes them.
  void prepare_lora_inference() const {
    for (const NamedLoraModule& m : lora_modules_) m.module->prepare_inference(options_.dtype);
  }
  const ModelConfig& config() const { return config_; }
  /// False when a layer reads device values on the host mid-forward (MoE routing sizes each expert's slice):
  /// such a model cannot be captured in a CUDA graph, so its decode runs eagerly.
  bool cuda_graph_capturable() const { return cuda_graph_capturable_; }
  const ModelOptions& options() const { return options_; }

 private:
  ModelConfig config_;
  ModelOptions options_;
  dist::ExpertParallel expert_parallel_;
  dist::Shard vocab_shard_;  // the vocabulary rows this rank holds (all of them without tensor parallelism)
  at::Tensor embed_tokens_;  // [vocab shard, hidden]
  std::vector<std::unique_ptr<DecoderLayer>> layers_;
  std::unique_ptr<RmsNorm> norm_;
  std::unique_ptr<lora::LoraLinear> lm_head_;  // weight shares storage with embed_tokens_ when tied
  RotaryEmbedding rope_;
  std::vector<NamedLoraModule> lora_modules_;
  std::map<std::string, dist::TensorSplit> parameter_splits_;
  bool cuda_graph_capturable_ = true;
};

}  // namespace skyrl_tx::models
