// The architecture registry: Hugging Face model_type / class → attention kind, MLP layout rule, norms; layer layouts.
#include "models/architectures.h"

#include <algorithm>

#include "common/errors.h"

namespace skyrl_tx::models {

const std::vector<ArchitectureSpec>& architectures() {
  static const std::vector<ArchitectureSpec> specs{
      // model_type, class, attention, MLP layout, qk_norm, zero_centered_norm
      {"qwen3", "Qwen3ForCausalLM", AttentionKind::kGqa, LayoutRule::kAllDense, true, false},
      {"llama", "LlamaForCausalLM", AttentionKind::kGqa, LayoutRule::kAllDense, false, false},
      {"qwen3_moe", "Qwen3MoeForCausalLM", AttentionKind::kGqa, LayoutRule::kSparseStep, true, false},
      {"deepseek_v3", "DeepseekV3ForCausalLM", AttentionKind::kMla, LayoutRule::kFirstKDense, false, false},
      // Qwen3.5's text model: Gated DeltaNet and gated-attention layers per layer_types, dense SwiGLU MLPs.
      {"qwen3_5_text", "Qwen3_5ForCausalLM", AttentionKind::kGatedGqa, LayoutRule::kAllDense, true, true},
      // ... and its MoE text model: every layer routed experts plus a sigmoid-gated shared expert.
      {"qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", AttentionKind::kGatedGqa, LayoutRule::kSparseStep, true, true},
  };
  return specs;
}

const ArchitectureSpec& find_architecture(const std::string& architecture) {
  for (const ArchitectureSpec& spec : architectures()) {
    if (spec.architecture == architecture) return spec;
  }
  std::string supported;
  for (const ArchitectureSpec& spec : architectures()) supported += (supported.empty() ? "" : ", ") + spec.architecture;
  throw Unimplemented(str_cat("model config: architecture '", architecture, "' is not supported (supported: ",
                              supported, ")"));
}

std::vector<MlpKind> mlp_layout(const ModelConfig& config) {
  const ArchitectureSpec& spec = find_architecture(config.architecture);
  std::vector<MlpKind> kinds(config.num_hidden_layers, MlpKind::kDense);
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    switch (spec.layout) {
      case LayoutRule::kAllDense:
        break;
      case LayoutRule::kSparseStep: {
        const auto& dense = config.mlp_only_layers;
        const bool forced_dense = std::find(dense.begin(), dense.end(), i) != dense.end();
        // transformers' Qwen3MoeDecoderLayer: num_experts > 0 and (i + 1) % decoder_sparse_step == 0.
        if (!forced_dense && config.num_experts > 0 && (i + 1) % config.decoder_sparse_step == 0) {
          kinds[i] = MlpKind::kMoe;
        }
        break;
      }
      case LayoutRule::kFirstKDense:
        if (i >= config.first_k_dense_replace) kinds[i] = MlpKind::kMoe;
        break;
    }
  }
  return kinds;
}

std::vector<MixerKind> mixer_layout(const ModelConfig& config) {
  std::vector<MixerKind> kinds(config.num_hidden_layers, MixerKind::kAttention);
  if (config.layer_types.empty()) return kinds;
  SKYRL_TX_CHECK(static_cast<int64_t>(config.layer_types.size()) == config.num_hidden_layers, InvalidArgument,
                 "model config: layer_types has ", config.layer_types.size(), " entries for ",
                 config.num_hidden_layers, " layers");
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    const std::string& type = config.layer_types[i];
    SKYRL_TX_CHECK(type == "full_attention" || type == "linear_attention", Unimplemented,
                   "model config: layer_types[", i, "] = '", type,
                   "' is not supported (supported: full_attention, linear_attention)");
    if (type == "linear_attention") kinds[i] = MixerKind::kGatedDeltaNet;
  }
  return kinds;
}

const char* attention_kind_name(AttentionKind kind) {
  switch (kind) {
    case AttentionKind::kGqa: return "gqa";
    case AttentionKind::kMla: return "mla";
    case AttentionKind::kGatedGqa: return "gated_gqa";
  }
  return "?";
}

const char* mixer_kind_name(MixerKind kind) {
  switch (kind) {
    case MixerKind::kAttention: return "attention";
    case MixerKind::kGatedDeltaNet: return "gated_deltanet";
  }
  return "?";
}

const char* layout_rule_name(LayoutRule rule) {
  switch (rule) {
    case LayoutRule::kAllDense: return "all_dense";
    case LayoutRule::kSparseStep: return "sparse_step";
    case LayoutRule::kFirstKDense: return "first_k_dense";
  }
  return "?";
}

const char* mlp_kind_name(MlpKind kind) {
  switch (kind) {
    case MlpKind::kDense: return "dense";
    case MlpKind::kMoe: return "moe";
  }
  return "?";
}

bool is_buffer_name(const std::string& name) {
  static const std::string kScoreBias = ".gate.e_score_correction_bias";
  return name.size() >= kScoreBias.size() && name.compare(name.size() - kScoreBias.size(), kScoreBias.size(),
                                                          kScoreBias) == 0;
}

}  // namespace skyrl_tx::models
