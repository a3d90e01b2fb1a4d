// Backend: the facade Python drives: one base model, its adapter slots, and batched logprob computation.
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend_config.h"
#include "lora/adapter_registry.h"
#include "models/causal_lm.h"

namespace skyrl_tx::backend {

/// NOTE: single owner — only the engine thread calls a Backend, so it holds no locks.
class Backend {
 public:
  /// weights: HF-named tensors of every shard. Throws InvalidArgument / Unimplemented for bad configs.
  Backend(const models::ModelConfig& model_config, const BackendConfig& config, models::WeightMap weights);

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

  const models::ModelConfig& model_config() const { return model_->config(); }
  const BackendConfig& config() const { return config_; }
  std::vector<std::string> adapter_module_names(const std::string& adapter_id) const;

 private:
  BackendConfig config_;
  std::unique_ptr<models::CausalLM> model_;
  lora::AdapterRegistry registry_;
};

}  // namespace skyrl_tx::backend
