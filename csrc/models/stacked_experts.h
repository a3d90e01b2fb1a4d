// StackedExperts: an MoE layer's held experts' base weights in stacks, run as grouped GEMMs (at::_grouped_mm).
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "lora/adapter_segments.h"

namespace skyrl_tx::models {

class SwiGluMlp;

/// When the routed experts run as grouped GEMMs instead of one matmul chain per non-empty expert (the
/// `grouped_expert_gemm` backend-config key).
enum class GroupedExpertGemm {
  kAuto,    // CUDA bfloat16 on compute capability >= 9.0: libtorch's CUTLASS grouped GEMM (Hopper, Blackwell)
  kAlways,  // wherever libtorch has the op: a CPU (ATen's reference loop: tests compare both paths there), or CUDA
            // bfloat16 on compute capability >= 8.0
  kNever,
};

/// "auto" | "always" | "never"; throws InvalidArgument naming the key otherwise.
GroupedExpertGemm parse_grouped_expert_gemm(const std::string& name);

/// The experts' gate_proj and up_proj weights live in one stack [E, 2 * inter, hidden] (expert j's gate rows, then
/// its up rows) and down_proj's in [E, hidden, inter]; each expert's LoraLinear keeps views of its slices, so
/// loading, saving and syncing weights by name read and write the stacks. A forward is then three grouped GEMMs
/// (gate and up in one) over rows sorted by expert, plus each expert's LoRA update where an adapter applies
/// (LoraLinear::adapter_update: its own factors, its own gradients).
class StackedExperts {
 public:
  /// `experts`: the held experts in order (expert parallelism: this rank's contiguous share), all of one shape.
  StackedExperts(std::vector<SwiGluMlp*> experts, GroupedExpertGemm policy);

  /// Whether forward runs for these rows: the policy and device allow it, every GEMM row is a multiple of 16
  /// bytes (the kernels' alignment), and the base weights are frozen (a full fine-tune's trainable copies take
  /// the per-expert path, whose gradients reach each expert's own weight).
  bool usable(const at::Tensor& rows) const;

  /// rows: [n, hidden], counts[j] rows of held expert j after those of the experts before it (sum = n > 0);
  /// segments: the adapter segments of each expert with rows, in order. → [n, hidden], each row its expert's
  /// down(silu(gate(x)) * up(x)), equal to SwiGluMlp::forward on its slice.
  at::Tensor forward(const at::Tensor& rows, const std::vector<int64_t>& counts,
                     const std::vector<lora::AdapterSegments>& segments) const;

 private:
  std::vector<SwiGluMlp*> experts_;
  GroupedExpertGemm policy_;
  int64_t hidden_, intermediate_;
  at::Tensor gate_up_;  // [E, 2 * inter, hidden]
  at::Tensor down_;     // [E, hidden, inter]
};

}  // namespace skyrl_tx::models
