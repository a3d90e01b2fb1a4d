// Decoder building blocks: RMSNorm, the token-mixer and MLP seams (GQA, SwiGLU), and the decoder layer.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

#include "dist/expert_parallel.h"
#include "dist/tensor_parallel.h"
#include "lora/lora_linear.h"
#include "models/hf_weights.h"
#include "models/model_config.h"
#include "models/stacked_experts.h"

namespace skyrl_tx::models {

/// Which LoRA target group a linear layer belongs to (the SDK's train_attn / train_mlp / train_unembed).
enum class LoraGroup { kAttention, kMlp, kUnembed };

/// A base-model tensor under its HF name (what full fine-tuning trains).
using NamedParameter = std::pair<std::string, at::Tensor>;

struct NamedLoraModule {
  std::string name;  // HF module path, e.g. "model.layers.0.self_attn.q_proj"
  LoraGroup group;
  lora::LoraLinear* module;
  // Under tensor parallelism: which factor is this rank's shard (B of a column-parallel layer, A of a row-parallel
  // one) and which is replicated with a partial gradient (summed over the group after each batch).
  dist::TpSplit split = dist::TpSplit::kReplicated;
  // kOwned (an expert under expert parallelism): the rank holding it, and its whole [out, in] (empty elsewhere).
  int owner = -1;
  int64_t whole_out = 0, whole_in = 0;
  // kColumn over sections (Gated DeltaNet's [q | k | v]): their whole sizes, each split on its own (TensorSplit).
  std::vector<int64_t> sections = {};
};

/// What every block needs to build its LoRA-capable linears.
struct BuildContext {
  WeightStore& weights;
  int64_t num_slots;
  int64_t max_rank;
  const dist::TensorParallel& tensor_parallel = dist::kNoTensorParallel;
  const dist::ExpertParallel* experts = nullptr;  // expert parallelism: the group MoE experts are spread over
  GroupedExpertGemm grouped_expert_gemm = GroupedExpertGemm::kAuto;  // how MoE layers run their experts
};

/// x / sqrt(mean(x^2) + eps) over the last dim, in float32 (every RMSNorm variant's first half).
at::Tensor rms_normalized_f32(const at::Tensor& x, double eps);

class RmsNorm {
 public:
  /// zero_centered: scale by (1 + weight) in float32, then cast (Qwen3.5's Qwen3_5RMSNorm; weights stored near 0).
  RmsNorm(at::Tensor weight, double eps, bool zero_centered = false)
      : weight_(std::move(weight)), eps_(eps), zero_centered_(zero_centered) {}
  /// Normalises over the last dim in float32, then scales in the input dtype (as transformers does).
  at::Tensor forward(const at::Tensor& x) const;
  const at::Tensor& weight() const { return weight_; }

 private:
  at::Tensor weight_;  // [dim]
  double eps_;
  bool zero_centered_;
};

/// Which keys a query attends: undefined `mask` is causal (SDPA's is_causal fast path; right-padded training and
/// prefill batches need no more), else a bool [B, 1, T, T] (or [B, 1, T, L] against a KV cache), true = may attend.
/// Packed sequences (batching::RowLayout::kPacked, no KV cache): one row holding several sequences back to back,
/// each attending causally within itself only (varlen attention; models/packed_attention.h). Token mixers with a
/// recurrent state (Gated DeltaNet) restart it at each start too.
struct AttentionMask {
  at::Tensor mask;
  std::vector<int64_t> sequence_starts;  // packed: each sequence's first token, then the total (cu_seqlens); else empty
  at::Tensor cu_seqlens;                 // packed: the same, int32 [S + 1] on the model's device (flash varlen)
  int64_t max_sequence_length = 0;       // packed: the longest sequence
  bool packed() const { return !sequence_starts.empty(); }
};

/// Generation: where attention writes this batch's K/V and, when decoding, reads the past from.
/// NOTE: in decode mode, batch row b is cache row b (the generator decodes cache rows [0, B)).
struct KvCacheView {
  const std::vector<at::Tensor>* keys = nullptr;    // per layer: [rows, kv_heads, max_len, head_dim]
  const std::vector<at::Tensor>* values = nullptr;  // per layer: same
  bool decode = false;
  at::Tensor rows;         // prefill: int64 [B], the cache row of each batch row (positions [0, T) written)
  // packed prefill (one row [1, total] of back-to-back prompts): int64 [total] each, token t's cache row and position
  at::Tensor token_rows, token_positions;
  at::Tensor positions;    // decode: int64 [B], where each row's single new token goes
  int64_t attend_len = 0;  // decode: keys [0, attend_len) are read
  at::Tensor attend_mask;  // decode: bool [B, 1, 1, attend_len]
  // Gated DeltaNet layers (models/gated_deltanet.h): per layer, undefined for attention layers.
  const std::vector<at::Tensor>* conv_states = nullptr;       // [rows, conv_dim, kernel - 1], the last inputs
  const std::vector<at::Tensor>* recurrent_states = nullptr;  // [rows, value_heads, key_dim, value_dim] float32
  at::Tensor lengths;      // prefill: int64 [B], each batch row's real tokens (its state is taken after them)
  at::Tensor batch_rows;   // decode: int64 [B] = arange(B) (built once per step; computed here when undefined)
  // extend (a prefix-cache hit): batch row 0's T tokens go to cache row `extend_row` at positions
  // [extend_start, extend_start + T) and attend to keys [0, extend_start + T) through attend_mask [1, 1, T, that].
  bool extend = false;
  int64_t extend_row = 0, extend_start = 0;
};

/// The attention seam: one implementation per AttentionKind (models/architectures.h).
class AttentionModule {
 public:
  virtual ~AttentionModule() = default;
  /// x: [B, T, hidden]; cos/sin: [B, T, head_dim] → [B, T, hidden]. `cache`/`layer`: generation only.
  virtual at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                             const AttentionMask& mask, const lora::AdapterSegments& segments,
                             const KvCacheView* cache = nullptr, int64_t layer = 0) const = 0;
  virtual void collect_lora(const std::string& prefix, std::vector<NamedLoraModule>& out) = 0;
  virtual void collect_parameters(const std::string& prefix, std::vector<NamedParameter>& out) const = 0;
};

/// The MLP seam: one implementation per MlpKind (dense SwiGLU here; routed experts in models/moe.h).
class MlpModule {
 public:
  virtual ~MlpModule() = default;
  /// x: [N, hidden] → [N, hidden]; `segments` covers the N rows.
  virtual at::Tensor forward(const at::Tensor& x, const lora::AdapterSegments& segments) const = 0;
  virtual void collect_lora(const std::string& prefix, std::vector<NamedLoraModule>& out) = 0;
  virtual void collect_parameters(const std::string& prefix, std::vector<NamedParameter>& out) const = 0;
};

/// Grouped-query attention with optional per-head q/k RMSNorm (Qwen3) and a bias on every projection (optional).
/// Gated (Qwen3.5, AttentionKind::kGatedGqa): q_proj yields [query | gate] per head and the attention output is
/// multiplied by sigmoid(gate) before o_proj.
class Attention : public AttentionModule {
 public:
  Attention(const ModelConfig& config, BuildContext& ctx, const std::string& prefix);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const AttentionMask& mask,
                     const lora::AdapterSegments& segments, const KvCacheView* cache = nullptr,
                     int64_t layer = 0) const override;
  void collect_lora(const std::string& prefix, std::vector<NamedLoraModule>& out) override;
  void collect_parameters(const std::string& prefix, std::vector<NamedParameter>& out) const override;

 private:
  const dist::TensorParallel& tp_;
  int64_t num_heads_, num_kv_heads_, head_dim_;  // this rank's heads (all of them without tensor parallelism)
  bool gated_;
  at::Tensor o_bias_;  // tensor parallel with a bias: o_proj's, added once after the sum (before o_proj_: it sets it)
  lora::LoraLinear q_proj_, k_proj_, v_proj_, o_proj_;  // q/k/v column-parallel by heads, o row-parallel
  std::vector<RmsNorm> qk_norm_;  // empty, or {q_norm, k_norm} for Qwen3
};

class SwiGluMlp : public MlpModule {
 public:
  /// The dense MLP: width config.intermediate_size, split over the tensor-parallel ranks (gate/up by columns,
  /// down by rows).
  SwiGluMlp(const ModelConfig& config, BuildContext& ctx, const std::string& prefix);
  /// Any width, replicated (an expert: moe_intermediate_size; shared experts: n_shared_experts times that).
  SwiGluMlp(int64_t hidden, int64_t intermediate, bool bias, BuildContext& ctx, const std::string& prefix,
            bool tensor_parallel = false);
  /// An expert under expert parallelism: whole on rank `owner`, empty (no weights, never run) on the others.
  static std::unique_ptr<SwiGluMlp> expert(int64_t hidden, int64_t intermediate, BuildContext& ctx,
                                           const std::string& prefix, int owner);
  /// False: an expert another rank holds.
  bool held() const { return owner_ < 0 || owner_ == held_by_; }
  /// The projections (an MoE layer's StackedExperts moves the experts' base weights into its stacks).
  const lora::LoraLinear& gate_proj() const { return gate_proj_; }
  const lora::LoraLinear& up_proj() const { return up_proj_; }
  const lora::LoraLinear& down_proj() const { return down_proj_; }
  lora::LoraLinear& gate_proj() { return gate_proj_; }
  lora::LoraLinear& up_proj() { return up_proj_; }
  lora::LoraLinear& down_proj() { return down_proj_; }
  /// x: [N, hidden] → [N, hidden]; down(silu(gate(x)) * up(x)) (Shazeer 2020).
  at::Tensor forward(const at::Tensor& x, const lora::AdapterSegments& segments) const override;
  void collect_lora(const std::string& prefix, std::vector<NamedLoraModule>& out) override;
  void collect_parameters(const std::string& prefix, std::vector<NamedParameter>& out) const override;

 private:
  SwiGluMlp(lora::LoraLinear gate, lora::LoraLinear up, lora::LoraLinear down, int owner, int rank, int64_t hidden,
            int64_t intermediate);
  const dist::TensorParallel* tp_;  // null: replicated
  int owner_ = -1, held_by_ = -1;   // an owned expert: its owner, and this rank
  int64_t hidden_ = 0, intermediate_ = 0;  // an owned expert's whole shape
  at::Tensor down_bias_;  // tensor parallel with a bias: down_proj's, added once after the sum (down_proj_ sets it)
  lora::LoraLinear gate_proj_, up_proj_, down_proj_;
};

class DecoderLayer {
 public:
  /// The MLP kind of layer `index` comes from the registry's layout (mlp_layout).
  DecoderLayer(const ModelConfig& config, BuildContext& ctx, const std::string& prefix, int64_t index = 0);
  /// Pre-norm residual block. x: [B, T, hidden] → [B, T, hidden].
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const AttentionMask& mask,
                     const lora::AdapterSegments& segments, const KvCacheView* cache = nullptr,
                     int64_t layer = 0) const;
  void collect_lora(const std::string& prefix, std::vector<NamedLoraModule>& out);
  void collect_parameters(const std::string& prefix, std::vector<NamedParameter>& out) const;

 private:
  RmsNorm input_layernorm_, post_attention_layernorm_;
  std::string mixer_name_;  // HF module name of the token mixer: "self_attn" or "linear_attn"
  std::unique_ptr<AttentionModule> mixer_;
  std::unique_ptr<MlpModule> mlp_;
};

/// Builds a LoraLinear from "<prefix>.weight" (+ "<prefix>.bias" when `bias`).
lora::LoraLinear make_lora_linear(BuildContext& ctx, const std::string& prefix, int64_t out, int64_t in, bool bias);
/// This rank's shard of the [out, in] linear: column-split (weight and bias rows), or row-split (weight columns;
/// the bias, replicated, goes to `*row_bias` under tensor parallelism so it is added once, after the sum).
lora::LoraLinear make_parallel_linear(BuildContext& ctx, const std::string& prefix, int64_t out, int64_t in,
                                      bool bias, dist::TpSplit split, at::Tensor* row_bias = nullptr);
/// A column-split [sum(sections), in] linear (no bias) whose output is consecutive sections, each split over the
/// ranks on its own: this rank holds its rows of every section, in order.
lora::LoraLinear make_sectioned_linear(BuildContext& ctx, const std::string& prefix,
                                       const std::vector<int64_t>& sections, int64_t in);

}  // namespace skyrl_tx::models
