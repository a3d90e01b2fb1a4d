// The architecture registry: Hugging Face model_type / class → attention kind, MLP layout rule, norms; layer layouts.
#pragma once

#include <string>
#include <vector>

#include "models/model_config.h"

namespace skyrl_tx::models {

/// Grouped-query attention; multi-head latent attention (DeepSeek V2/V3); Qwen3.5's gated GQA (q_proj also
/// yields a per-head output gate, sigmoid-applied before o_proj).
enum class AttentionKind { kGqa, kMla, kGatedGqa };
/// What mixes tokens in one layer: softmax attention (the spec's AttentionKind) or a Gated DeltaNet
/// (linear attention with a recurrent state, Qwen3.5's "linear_attention" layers).
enum class MixerKind { kAttention, kGatedDeltaNet };
enum class MlpKind { kDense, kMoe };  // SwiGLU; routed SwiGLU experts (+ optional shared experts)

/// How config.json says which layers are MoE layers.
enum class LayoutRule {
  kAllDense,         // Llama 3, Qwen3
  kSparseStep,       // qwen3_moe: MoE where (i + 1) % decoder_sparse_step == 0 and i not in mlp_only_layers
  kFirstKDense,      // deepseek_v3: dense for i < first_k_dense_replace, MoE after
};

struct ArchitectureSpec {
  std::string model_type;    // config.json "model_type", e.g. "qwen3_moe"
  std::string architecture;  // config.json "architectures"[0], e.g. "Qwen3MoeForCausalLM"
  AttentionKind attention;
  LayoutRule layout;
  bool qk_norm;              // RMSNorm over head_dim on q and k before RoPE (Qwen3 family)
  bool zero_centered_norm;   // every RMSNorm scales by (1 + weight) (Qwen3.5), not by weight
};

/// Every supported architecture, in a stable order (the Python table is tested against this list).
const std::vector<ArchitectureSpec>& architectures();
/// The spec for `architecture` (an HF class name); throws Unimplemented naming the supported ones.
const ArchitectureSpec& find_architecture(const std::string& architecture);
/// One MlpKind per layer, from the spec's layout rule and the config's MoE fields.
std::vector<MlpKind> mlp_layout(const ModelConfig& config);
/// One MixerKind per layer, from config.layer_types (all attention when it is empty).
std::vector<MixerKind> mixer_layout(const ModelConfig& config);

const char* attention_kind_name(AttentionKind kind);
const char* layout_rule_name(LayoutRule rule);
const char* mlp_kind_name(MlpKind kind);
const char* mixer_kind_name(MixerKind kind);
/// Tensors a model copy carries and saves that no optimizer updates (transformers' buffers), e.g. DeepSeek V3's
/// router `e_score_correction_bias`: its gradient is always 0, but AdamW's weight decay would still shrink it.
bool is_buffer_name(const std::string& name);

}  // namespace skyrl_tx::models
