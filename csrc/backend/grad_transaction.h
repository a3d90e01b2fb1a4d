// GradTransaction: makes one training batch's gradient accumulation all-or-nothing.
#pragma once

#include <ATen/ATen.h>

#include <set>
#include <utility>
#include <vector>

#include "dist/collectives.h"
#include "lora/lora_linear.h"
#include "models/causal_lm.h"

namespace skyrl_tx::backend {

/// Sets aside the gradients a batch will add to (the LoRA accumulators of `lora_slots` in every module of
/// `base`, and every parameter's .grad of each of `full_models`), so the batch accumulates into fresh, empty
/// ones. commit() adds the set-aside gradients into the batch's; destruction without commit (a micro-batch
/// threw: out of memory, a device error) drops the batch's partial gradients and puts the set-aside tensors
/// back untouched, so a failed batch leaves every model's gradients exactly as before it.
/// Cost: nothing when no gradients are pending (optim_step frees them); while gradients are pending (several
/// forward_backward calls before an optim_step), one more gradient buffer per touched tensor while the batch
/// runs, and one add at commit.
class GradTransaction {
 public:
  GradTransaction(const models::CausalLM& base, const std::set<int64_t>& lora_slots,
                  const std::vector<const models::CausalLM*>& full_models);
  GradTransaction(const GradTransaction&) = delete;
  GradTransaction& operator=(const GradTransaction&) = delete;
  ~GradTransaction();

  /// Data parallelism: sums the batch's gradients over the ranks of `group` (one flat buffer; a tensor this
  /// rank did not touch contributes zeros). Every rank calls it with the same slots and models, before commit.
  void all_reduce(dist::Collectives& group);

  /// Keeps the batch's gradients plus the set-aside ones. Leaves the set-aside tensors unmodified until the
  /// end, so a failure inside commit itself still rolls back exactly.
  void commit();

 private:
  struct LoraGrads {
    lora::LoraLinear* module;
    int64_t slot;
    std::pair<at::Tensor, at::Tensor> before;  // (A, B) accumulators before the batch; undefined if none
  };
  struct ParamGrad {
    at::Tensor param;
    at::Tensor before;  // .grad before the batch; undefined if none
  };
  std::vector<LoraGrads> lora_;
  std::vector<ParamGrad> params_;
  bool committed_ = false;
};

}  // namespace skyrl_tx::backend
