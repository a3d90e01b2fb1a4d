// ModelConfig: the architecture hyper-parameters of a decoder (Qwen3, Llama 3, MoE, Qwen3.5; filled from config.json).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace skyrl_tx::models {

/// Llama 3.1+ frequency-dependent RoPE scaling ("rope_type": "llama3"); type "default" = none.
struct RopeScaling {
  std::string type = "default";
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
  // YaRN ("rope_type": "yarn", DeepSeek V3): the ramp between interpolated and extrapolated frequencies, and the
  // mscale terms of the cos/sin attention factor (attention_factor 0 = derived from factor, mscale, mscale_all_dim).
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  double mscale = 0.0;
  double mscale_all_dim = 0.0;
  double attention_factor = 0.0;
};

struct ModelConfig {
  std::string architecture;  // an HF class in the registry (models/architectures.h), e.g. "Qwen3MoeForCausalLM"
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
  // Mixture of experts (read only by MoE layers; which layers those are is the registry's layout rule).
  int64_t num_experts = 0;            // routed experts per MoE layer
  int64_t num_experts_per_tok = 0;    // top-k
  int64_t moe_intermediate_size = 0;  // each routed expert's SwiGLU width
  bool norm_topk_prob = false;        // renormalise the top-k probabilities to sum to 1
  int64_t decoder_sparse_step = 1;    // qwen3_moe layout
  std::vector<int64_t> mlp_only_layers;  // qwen3_moe layout: layers forced dense
  int64_t first_k_dense_replace = 0;  // deepseek_v3 layout
  int64_t n_shared_experts = 0;       // shared SwiGLU experts, width n_shared_experts * moe_intermediate_size
  int64_t shared_expert_intermediate_size = 0;  // Qwen3.5 MoE: one shared expert of this width, sigmoid-gated
  // Router: "softmax" (Qwen3 MoE) or "sigmoid" (DeepSeek V3: sigmoid scores, a score-correction bias that only
  // steers the choice, group-limited top-k over n_group groups keeping topk_group, weights x routed_scaling_factor).
  std::string scoring_func = "softmax";
  int64_t n_group = 1;
  int64_t topk_group = 1;
  double routed_scaling_factor = 1.0;
  // Multi-head latent attention (DeepSeek V3). head_dim is the RoPE part, qk_rope_head_dim.
  int64_t q_lora_rank = 0;  // 0: a plain q_proj
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;
  bool rope_interleave = false;  // RoPE on interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek's weights)
  double partial_rotary_factor = 1.0;  // RoPE on the first int(head_dim * factor) dims only (Qwen3.5: 0.25)
  // Hybrid linear attention (Qwen3.5): config.json "layer_types", one "linear_attention" (Gated DeltaNet) or
  // "full_attention" per layer; empty = every layer full attention. The linear_* fields shape the DeltaNet layers.
  std::vector<std::string> layer_types;
  int64_t linear_num_key_heads = 0;
  int64_t linear_num_value_heads = 0;
  int64_t linear_key_head_dim = 0;
  int64_t linear_value_head_dim = 0;
  int64_t linear_conv_kernel_dim = 0;  // the causal depthwise conv1d's width before the delta rule

  int64_t resolved_head_dim() const { return head_dim > 0 ? head_dim : hidden_size / num_attention_heads; }
  /// The dims RoPE rotates: int(head_dim * partial_rotary_factor), as transformers computes it.
  int64_t rotary_dim() const {
    return static_cast<int64_t>(static_cast<double>(resolved_head_dim()) * partial_rotary_factor);
  }
  /// True when some layer is a Gated DeltaNet (its generation state is recurrent, not a per-token KV cache).
  bool has_linear_attention() const;
  /// What the KV cache holds per layer and token: GQA: [kv_heads, head_dim] K and V; MLA: the compressed latent,
  /// one "head" of kv_lora_rank + qk_rope_head_dim, and no V (0).
  int64_t cache_kv_heads() const;
  /// The KV heads one of `tensor_parallel_size` ranks caches: its share of GQA's, or MLA's whole latent (every rank
  /// expands it into its own heads).
  int64_t cache_kv_heads_per_rank(int64_t tensor_parallel_size) const;
  int64_t cache_key_dim() const;
  int64_t cache_value_dim() const;
  /// Throws InvalidArgument naming the first inconsistent field.
  void validate() const;
};

}  // namespace skyrl_tx::models
