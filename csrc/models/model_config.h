// ModelConfig: the architecture hyper-parameters of a Qwen3 / Llama 3 decoder (filled from config.json by Python).
#pragma once

#include <cstdint>
#include <string>

namespace skyrl_tx::models {

/// Llama 3.1+ frequency-dependent RoPE scaling ("rope_type": "llama3"); type "default" = none.
struct RopeScaling {
  std::string type = "default";
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

struct ModelConfig {
  std::string architecture;  // "Qwen3ForCausalLM" or "LlamaForCausalLM"
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;  // 0 = hidden_size / num_attention_heads
  int64_t max_position_embeddings = 4096;
  double rope_theta = 10000.0;
  double rms_norm_eps = 1e-6;
  bool qk_norm = false;  // Qwen3: RMSNorm over head_dim on q and k before RoPE
  bool tie_word_embeddings = false;
  bool attention_bias = false;
  bool mlp_bias = false;
  RopeScaling rope_scaling;

  int64_t resolved_head_dim() const { return head_dim > 0 ? head_dim : hidden_size / num_attention_heads; }
  /// Throws InvalidArgument naming the first inconsistent field.
  void validate() const;
};

}  // namespace skyrl_tx::models
