// Validation of ModelConfig: catches configs the decoder cannot run before any weight is touched.
#include "models/model_config.h"

#include <algorithm>

#include "common/errors.h"
#include "models/architectures.h"

namespace skyrl_tx::models {

void ModelConfig::validate() const {
  (void)find_architecture(architecture);  // throws Unimplemented naming the supported ones
  auto positive = [](const char* field, int64_t value) {
    SKYRL_TX_CHECK(value > 0, InvalidArgument, "model config: ", field, " must be > 0 (got ", value, ")");
  };
  positive("vocab_size", vocab_size);
  positive("hidden_size", hidden_size);
  positive("intermediate_size", intermediate_size);
  positive("num_hidden_layers", num_hidden_layers);
  positive("num_attention_heads", num_attention_heads);
  positive("num_key_value_heads", num_key_value_heads);
  SKYRL_TX_CHECK(num_attention_heads % num_key_value_heads == 0, InvalidArgument,
                 "model config: num_attention_heads (", num_attention_heads,
                 ") must be a multiple of num_key_value_heads (", num_key_value_heads, ")");
  SKYRL_TX_CHECK(resolved_head_dim() % 2 == 0, InvalidArgument, "model config: head_dim must be even for RoPE (got ",
                 resolved_head_dim(), ")");
  SKYRL_TX_CHECK(rms_norm_eps > 0, InvalidArgument, "model config: rms_norm_eps must be > 0");
  SKYRL_TX_CHECK(rope_theta > 0, InvalidArgument, "model config: rope_theta must be > 0");
  SKYRL_TX_CHECK(rope_scaling.type == "default" || rope_scaling.type == "llama3" || rope_scaling.type == "yarn",
                 Unimplemented, "model config: rope scaling type '", rope_scaling.type,
                 "' is not supported (supported: llama3, yarn)");
  if (rope_scaling.type == "yarn") {
    SKYRL_TX_CHECK(rope_scaling.factor > 0 && rope_scaling.original_max_position_embeddings > 0, InvalidArgument,
                   "model config: yarn rope_scaling needs factor and original_max_position_embeddings > 0");
  }
  if (find_architecture(architecture).attention == AttentionKind::kMla) {
    positive("kv_lora_rank", kv_lora_rank);
    positive("qk_nope_head_dim", qk_nope_head_dim);
    positive("qk_rope_head_dim", qk_rope_head_dim);
    positive("v_head_dim", v_head_dim);
    SKYRL_TX_CHECK(q_lora_rank >= 0, InvalidArgument, "model config: q_lora_rank must be >= 0");
    SKYRL_TX_CHECK(resolved_head_dim() == qk_rope_head_dim, InvalidArgument, "model config: head_dim (",
                   resolved_head_dim(), ") must equal qk_rope_head_dim (", qk_rope_head_dim, ") for MLA");
  }
  if (rope_scaling.type == "llama3") {
    SKYRL_TX_CHECK(rope_scaling.factor > 0 && rope_scaling.low_freq_factor > 0 &&
                       rope_scaling.original_max_position_embeddings > 0,
                   InvalidArgument, "model config: rope_scaling factor, low_freq_factor and "
                   "original_max_position_embeddings must be > 0 (got ", rope_scaling.factor, ", ",
                   rope_scaling.low_freq_factor, ", ", rope_scaling.original_max_position_embeddings, ")");
    SKYRL_TX_CHECK(rope_scaling.high_freq_factor > rope_scaling.low_freq_factor, InvalidArgument,
                   "model config: rope_scaling.high_freq_factor must exceed low_freq_factor");
  }
  SKYRL_TX_CHECK(partial_rotary_factor > 0 && partial_rotary_factor <= 1 && rotary_dim() % 2 == 0, InvalidArgument,
                 "model config: partial_rotary_factor (", partial_rotary_factor,
                 ") must be in (0, 1] and leave an even number of rotary dims (got ", rotary_dim(), ")");
  if (has_linear_attention()) {  // mixer_layout (in has_linear_attention) has checked layer_types itself
    SKYRL_TX_CHECK(find_architecture(architecture).attention == AttentionKind::kGatedGqa, Unimplemented,
                   "model config: linear_attention layers are only supported in the Qwen3.5 family (got ",
                   architecture, ")");
    positive("linear_num_key_heads", linear_num_key_heads);
    positive("linear_num_value_heads", linear_num_value_heads);
    positive("linear_key_head_dim", linear_key_head_dim);
    positive("linear_value_head_dim", linear_value_head_dim);
    positive("linear_conv_kernel_dim", linear_conv_kernel_dim);
    SKYRL_TX_CHECK(linear_num_value_heads % linear_num_key_heads == 0, InvalidArgument,
                   "model config: linear_num_value_heads (", linear_num_value_heads,
                   ") must be a multiple of linear_num_key_heads (", linear_num_key_heads, ")");
  }
  SKYRL_TX_CHECK(decoder_sparse_step > 0, InvalidArgument, "model config: decoder_sparse_step must be > 0 (got ",
                 decoder_sparse_step, ")");
  const std::vector<MlpKind> layout = mlp_layout(*this);
  if (std::find(layout.begin(), layout.end(), MlpKind::kMoe) != layout.end()) {
    positive("moe_intermediate_size", moe_intermediate_size);
    positive("num_experts_per_tok", num_experts_per_tok);
    SKYRL_TX_CHECK(num_experts_per_tok <= num_experts, InvalidArgument, "model config: num_experts_per_tok (",
                   num_experts_per_tok, ") must be <= num_experts (", num_experts, ")");
    SKYRL_TX_CHECK(n_shared_experts >= 0, InvalidArgument, "model config: n_shared_experts must be >= 0");
    SKYRL_TX_CHECK(scoring_func == "softmax" || scoring_func == "sigmoid", Unimplemented,
                   "model config: scoring_func '", scoring_func, "' is not supported (supported: softmax, sigmoid)");
    SKYRL_TX_CHECK(n_group > 0 && num_experts % n_group == 0 && topk_group > 0 && topk_group <= n_group,
                   InvalidArgument, "model config: n_group (", n_group, ") must divide num_experts (", num_experts,
                   ") and topk_group (", topk_group, ") must be in [1, n_group]");
    SKYRL_TX_CHECK(n_group == 1 || num_experts / n_group >= 2, InvalidArgument,
                   "model config: group-limited routing needs >= 2 experts per group");
  }
}

bool ModelConfig::has_linear_attention() const {
  const std::vector<MixerKind> mixers = mixer_layout(*this);
  return std::find(mixers.begin(), mixers.end(), MixerKind::kGatedDeltaNet) != mixers.end();
}

int64_t ModelConfig::cache_kv_heads() const {
  return find_architecture(architecture).attention == AttentionKind::kMla ? 1 : num_key_value_heads;
}

int64_t ModelConfig::cache_kv_heads_per_rank(int64_t tensor_parallel_size) const {
  return find_architecture(architecture).attention == AttentionKind::kMla ? 1
                                                                          : num_key_value_heads / tensor_parallel_size;
}

int64_t ModelConfig::cache_key_dim() const {
  return find_architecture(architecture).attention == AttentionKind::kMla ? kv_lora_rank + qk_rope_head_dim
                                                                           : resolved_head_dim();
}

int64_t ModelConfig::cache_value_dim() const {
  return find_architecture(architecture).attention == AttentionKind::kMla ? 0 : resolved_head_dim();
}

}  // namespace skyrl_tx::models
