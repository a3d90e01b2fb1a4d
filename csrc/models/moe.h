// MoeMlp: a routed mixture of SwiGLU experts (softmax or DeepSeek sigmoid router; shared experts), LoRA on every expert.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

#include "models/layers.h"

namespace skyrl_tx::models {

/// Which expert each token goes to, grouped by expert (what the expert loop consumes).
struct ExpertRouting {
  at::Tensor token;            // int64 [N * k]: the token of each (token, choice) pair, sorted by expert (stable)
  at::Tensor weight;           // [N * k] in the activation dtype: that pair's routing weight (differentiable)
  std::vector<int64_t> count;  // [E] on the host: pairs per expert (sum = N * k)
};

/// Routes each token to top-k experts and sums their outputs weighted by the router's probabilities. No token is
/// ever dropped (no capacity factor). Experts run over contiguous slices of the expert-sorted tokens, as grouped
/// GEMMs (StackedExperts) or one matmul chain per non-empty expert, and the weighted results are scattered back
/// with one index_add (Fedus et al. 2021 without capacity; transformers' Qwen3MoeSparseMoeBlock computes the same
/// sum).
class MoeMlp : public MlpModule {
 public:
  /// HF names: "<prefix>.gate.weight" [E, hidden], "<prefix>.experts.<e>.{gate,up,down}_proj.weight",
  /// "<prefix>.shared_experts.*" when config.n_shared_experts > 0 (or "<prefix>.shared_expert.*" and
  /// "<prefix>.shared_expert_gate.weight" [1, hidden] when config.shared_expert_intermediate_size > 0, Qwen3.5 MoE),
  /// and "<prefix>.gate.e_score_correction_bias" [E] with the sigmoid router.
  MoeMlp(const ModelConfig& config, BuildContext& ctx, const std::string& prefix);
  /// x: [N, hidden] → [N, hidden].
  at::Tensor forward(const at::Tensor& x, const lora::AdapterSegments& segments) const override;
  /// Softmax: over all experts in float32, top-k, optional renormalisation (Qwen3MoeTopKRouter).
  /// Sigmoid: DeepSeek V3's group-limited choice on biased scores, unbiased weights (DeepseekV3TopkRouter).
  ExpertRouting route(const at::Tensor& x) const;
  /// Expert LoRA modules are in group kMlp; the router is not LoRA-adapted (full fine-tuning trains it).
  void collect_lora(const std::string& prefix, std::vector<NamedLoraModule>& out) override;
  void collect_parameters(const std::string& prefix, std::vector<NamedParameter>& out) const override;
  int64_t num_experts() const { return static_cast<int64_t>(experts_.size()); }
  /// The experts this rank holds (all of them without expert parallelism).
  int64_t experts_held() const;

 private:
  int64_t top_k_;
  bool norm_topk_prob_;
  bool sigmoid_;
  int64_t n_group_, topk_group_;
  double routed_scaling_factor_;
  at::Tensor gate_;  // [E, hidden] router weight
  at::Tensor score_bias_;  // [E] float32 e_score_correction_bias (sigmoid router only; steers the choice, not weights)

  /// The routed experts' weighted sum [N, hidden] when every rank of the group holds the same tokens (or there is
  /// no group): each rank runs its experts' slices, and the group sums.
  at::Tensor routed_replicated(const at::Tensor& x, const lora::AdapterSegments& segments) const;
  /// The same sum when the group's ranks hold different tokens (a data-parallel pass): each (token, expert) pair
  /// goes to the expert's rank and its output comes back (moe_exchange.cpp).
  at::Tensor routed_exchanged(const at::Tensor& x, const lora::AdapterSegments& segments) const;
  /// Runs the held experts `first`, `first + 1`, ... over `rows` [n, hidden] grouped by expert (counts[j] rows of
  /// expert first + j; segments: those of each expert with rows, in order) → [n, hidden]: as grouped GEMMs when
  /// the stacks can (StackedExperts::usable), else one matmul chain per expert with rows.
  at::Tensor run_experts(const at::Tensor& rows, int64_t first, const std::vector<int64_t>& counts,
                         const std::vector<lora::AdapterSegments>& segments) const;
  /// [N, k] weights (float32) and expert indices.
  std::pair<at::Tensor, at::Tensor> top_k(const at::Tensor& x) const;
  std::vector<std::unique_ptr<SwiGluMlp>> experts_;  // expert parallelism: the others' are empty (held() false)
  std::unique_ptr<StackedExperts> stacked_;  // the held experts' base weights (each expert's are views of it)
  int64_t first_held_ = 0;                   // the first held expert (its stack index is 0)
  const dist::ExpertParallel* split_over_ = nullptr;  // expert parallelism: the group the experts are spread over
  std::unique_ptr<SwiGluMlp> shared_;  // null without shared experts
  std::string shared_name_ = "shared_experts";  // its HF module name (DeepSeek's; Qwen3.5 MoE: "shared_expert")
  at::Tensor shared_gate_;  // [1, hidden] Qwen3.5 MoE's shared_expert_gate (undefined: the shared output is added)
};

/// The adapter segments of one expert's slice of the expert-sorted tokens. `segments` covers the N tokens in
/// row order; `token` [n_e] are that expert's tokens in increasing order (so each adapter's tokens stay
/// contiguous) and `per_segment` [num segments] counts how many of them fall in each of `segments`' segments.
lora::AdapterSegments expert_segments(const lora::AdapterSegments& segments, const at::Tensor& token,
                                      const int64_t* per_segment);

}  // namespace skyrl_tx::models
