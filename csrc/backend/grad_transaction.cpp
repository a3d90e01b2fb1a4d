// GradTransaction: makes one training batch's gradient accumulation all-or-nothing.
#include "backend/grad_transaction.h"

#include <c10/core/GradMode.h>

#include <unordered_set>

#include "common/errors.h"
#include "models/architectures.h"

namespace skyrl_tx::backend {
namespace {

// fresh + before, into `fresh` (the batch's own buffer): `before` is never written, so a rollback stays exact.
at::Tensor merged(at::Tensor fresh, const at::Tensor& before) {
  if (!before.defined()) return fresh;
  if (!fresh.defined()) return before;
  fresh.add_(before);
  return fresh;
}

}  // namespace

GradTransaction::GradTransaction(const models::CausalLM& base, const std::set<int64_t>& lora_slots,
                                 const std::vector<FullModelGrads>& full_models) {
  for (int64_t slot : lora_slots) {
    for (const models::NamedLoraModule& m : base.lora_modules()) {
      lora_.push_back({m.module, m.split, slot, {}});
    }
  }
  std::unordered_set<const c10::TensorImpl*> seen;  // a tied tensor is set aside once
  for (const FullModelGrads& full : full_models) {
    if (full.zero) sharded_.push_back({full.zero, {}, {}});
    for (const auto& [name, param] : full.model->named_parameters()) {
      if (full.zero && !models::is_buffer_name(name)) sharded_.back().stepped.push_back(param);
      if (seen.insert(param.unsafeGetTensorImpl()).second) {
        params_.push_back({param, at::Tensor(), full.zero != nullptr, full.model->partial_gradient(name)});
      }
    }
  }
  // Only now, with nothing left that allocates (and could throw before a destructor exists to undo it),
  // set the gradients aside.
  for (LoraGrads& g : lora_) g.before = g.module->take_slot_grads(g.slot);
  for (ParamGrad& p : params_) p.before = std::exchange(p.param.mutable_grad(), at::Tensor());
}

void GradTransaction::all_reduce(dist::Collectives& group, bool owned_are_whole) {
  c10::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;  // the order of lora_ then params_: the same on every rank
  for (LoraGrads& g : lora_) {
    if (owned_are_whole && g.split == dist::TpSplit::kOwned) continue;
    grads.push_back(g.module->slot_grad_a(g.slot));  // allocated (zeros) where this rank had no rows
    grads.push_back(g.module->slot_grad_b(g.slot));
  }
  for (ParamGrad& p : params_) {
    if (p.sharded) continue;
    if (!p.param.grad().defined()) p.param.mutable_grad() = at::zeros_like(p.param);
    grads.push_back(p.param.grad());
  }
  group.all_reduce_sum_flat(grads);
  for (ShardedBatch& batch : sharded_) {
    std::vector<at::Tensor> model_grads;
    for (const at::Tensor& param : batch.stepped) model_grads.push_back(param.grad());  // undefined = zeros
    batch.range = batch.zero->reduce_scatter(model_grads, group);
  }
  for (ParamGrad& p : params_) {  // the full-size gradients are no longer needed: only the range is kept
    if (p.sharded) p.param.mutable_grad() = at::Tensor();
  }
}

void GradTransaction::sum_partial_over(const dist::TensorParallel& tp) {
  c10::NoGradGuard no_grad;
  std::vector<at::Tensor> partial;  // lora_'s order: the same on every rank
  for (LoraGrads& g : lora_) {
    if (!g.module->slot_enabled(g.slot)) continue;
    if (g.split == dist::TpSplit::kColumn) partial.push_back(g.module->slot_grad_a(g.slot));
    if (g.split == dist::TpSplit::kRow) partial.push_back(g.module->slot_grad_b(g.slot));
    if (g.split == dist::TpSplit::kPartial) {
      partial.push_back(g.module->slot_grad_a(g.slot));
      partial.push_back(g.module->slot_grad_b(g.slot));
    }
  }
  for (ParamGrad& p : params_) {
    if (!p.partial) continue;
    if (!p.param.grad().defined()) p.param.mutable_grad() = at::zeros_like(p.param);
    partial.push_back(p.param.grad());
  }
  tp.group().all_reduce_sum_flat(partial);
}

void GradTransaction::commit() {
  c10::NoGradGuard no_grad;
  for (LoraGrads& g : lora_) {
    auto [a, b] = g.module->take_slot_grads(g.slot);
    g.module->put_slot_grads(g.slot, {merged(a, g.before.first), merged(b, g.before.second)});
  }
  for (ShardedBatch& batch : sharded_) {
    SKYRL_TX_CHECK(batch.range.defined(), Internal, "a ZeRO model's batch was committed without all_reduce");
  }
  for (ParamGrad& p : params_) p.param.mutable_grad() = p.sharded ? p.before : merged(p.param.grad(), p.before);
  for (ShardedBatch& batch : sharded_) batch.zero->add_pending(std::move(batch.range));
  committed_ = true;
}

GradTransaction::~GradTransaction() {
  if (committed_) return;
  // Reverse order, so that whatever was set aside first is what ends up in place.
  for (auto it = params_.rbegin(); it != params_.rend(); ++it) it->param.mutable_grad() = it->before;
  for (auto it = lora_.rbegin(); it != lora_.rend(); ++it) it->module->put_slot_grads(it->slot, it->before);
}

}  // namespace skyrl_tx::backend
