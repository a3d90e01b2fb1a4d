// GradTransaction: makes one training batch's gradient accumulation all-or-nothing.
#pragma once

#include <ATen/ATen.h>

#include <set>
#include <utility>
#include <vector>

#include "dist/collectives.h"
#include "dist/tensor_parallel.h"
#include "lora/lora_linear.h"
#include "models/causal_lm.h"
#include "optim/zero_adamw.h"

namespace skyrl_tx::backend {

/// A full fine-tune in a batch; `zero` set: its gradients are sharded over the data-parallel ranks (ZeRO).
struct FullModelGrads {
  const models::CausalLM* model;
  optim::ZeroAdamState* zero = nullptr;
};

/// Sets aside the gradients a batch will add to (the LoRA accumulators of `lora_slots` in every module of
/// `base`, and every parameter's .grad of each of `full_models`), so the batch accumulates into fresh, empty
/// ones. A ZeRO model's gradients end the batch as its rank's range of their sum (all_reduce), which commit
/// adds to the model's pending range. commit() adds the set-aside gradients into the batch's; destruction without commit (a micro-batch
/// threw: out of memory, a device error) drops the batch's partial gradients and puts the set-aside tensors
/// back untouched, so a failed batch leaves every model's gradients exactly as before it.
/// Cost: nothing when no gradients are pending (optim_step frees them); while gradients are pending (several
/// forward_backward calls before an optim_step), one more gradient buffer per touched tensor while the batch
/// runs, and one add at commit.
class GradTransaction {
 public:
  GradTransaction(const models::CausalLM& base, const std::set<int64_t>& lora_slots,
                  const std::vector<FullModelGrads>& full_models);
  GradTransaction(const GradTransaction&) = delete;
  GradTransaction& operator=(const GradTransaction&) = delete;
  ~GradTransaction();

  /// Data parallelism: sums the batch's gradients over the ranks of `group` (one flat buffer; a tensor this
  /// rank did not touch contributes zeros); a ZeRO model's are reduce-scattered instead (one collective per
  /// model) and its full-size .grad tensors freed. Every rank calls it with the same slots and models, before
  /// commit.
  /// `owned_are_whole`: experts spread over this (data-parallel) group: an expert's factors live on its rank only,
  /// and the token exchange already gave it every rank's share, so they are left out.
  void all_reduce(dist::Collectives& group, bool owned_are_whole = false);

  /// Tensor parallelism: the replicated LoRA factors (A of a column-parallel layer, B of a row-parallel one) got
  /// each rank's share of their gradient; sums them over `tp` (one flat buffer) so every rank holds the whole.
  /// Every rank of the group calls it with the same slots, before all_reduce and commit.
  void sum_partial_over(const dist::TensorParallel& tp);

  /// Keeps the batch's gradients plus the set-aside ones. Leaves the set-aside tensors unmodified until the
  /// end, so a failure inside commit itself still rolls back exactly.
  void commit();

 private:
  struct LoraGrads {
    lora::LoraLinear* module;
    dist::TpSplit split;
    int64_t slot;
    std::pair<at::Tensor, at::Tensor> before;  // (A, B) accumulators before the batch; undefined if none
  };
  struct ParamGrad {
    at::Tensor param;
    at::Tensor before;  // .grad before the batch; undefined if none
    bool sharded = false;  // a ZeRO model's: reduce-scattered, not all-reduced
    bool partial = false;  // tensor parallel: replicated, with this rank's share of its gradient (q/k norms)
  };
  struct ShardedBatch {
    optim::ZeroAdamState* zero;
    std::vector<at::Tensor> stepped;  // the model's stepped parameters, in the ZeRO layout's order
    at::Tensor range;                 // [S] this rank's range of the batch's summed gradients (all_reduce)
  };
  std::vector<LoraGrads> lora_;
  std::vector<ParamGrad> params_;
  std::vector<ShardedBatch> sharded_;
  bool committed_ = false;
};

}  // namespace skyrl_tx::backend
