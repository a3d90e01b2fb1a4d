// AdamW with decoupled weight decay and global-norm clipping, applied to one model's tensors at a time.
#include "optim/adamw.h"

#include <c10/core/GradMode.h>

#include <cmath>

#include "common/errors.h"

namespace skyrl_tx::optim {

void AdamParams::validate() const {
  SKYRL_TX_CHECK(std::isfinite(learning_rate) && learning_rate >= 0, InvalidArgument,
                 "optim_step: learning_rate must be a finite number >= 0 (got ", learning_rate, ")");
  SKYRL_TX_CHECK(beta1 >= 0 && beta1 < 1, InvalidArgument, "optim_step: beta1 must be in [0, 1) (got ", beta1, ")");
  SKYRL_TX_CHECK(beta2 >= 0 && beta2 < 1, InvalidArgument, "optim_step: beta2 must be in [0, 1) (got ", beta2, ")");
  SKYRL_TX_CHECK(eps >= 0, InvalidArgument, "optim_step: eps must be >= 0 (got ", eps, ")");
  SKYRL_TX_CHECK(weight_decay >= 0, InvalidArgument, "optim_step: weight_decay must be >= 0 (got ", weight_decay, ")");
  SKYRL_TX_CHECK(grad_clip_norm >= 0, InvalidArgument, "optim_step: grad_clip_norm must be >= 0 (got ",
                 grad_clip_norm, "); 0 disables clipping");
}

double global_grad_norm(const std::vector<TrainableTensor>& tensors, const dist::TensorParallel& tp) {
  std::vector<at::Tensor> grads, sharded;
  for (const auto& t : tensors) {
    if (t.grad.defined()) (tp.enabled() && !t.split.replicated() ? sharded : grads).push_back(t.grad);
  }
  // Per-tensor norms in one multi-tensor pass, combined in double: one host sync, not one per tensor.
  const auto sum_of_squares = [](const std::vector<at::Tensor>& ts) {
    if (ts.empty()) return at::zeros({1}, at::kDouble);
    return at::stack(at::_foreach_norm(ts)).to(at::kCPU, at::kDouble).pow(2).sum().reshape({1});
  };
  at::Tensor total = sum_of_squares(grads);  // [1]
  if (tp.enabled()) {  // every rank holds a different part of the sharded tensors: their squares summed over ranks
    at::Tensor parts = sum_of_squares(sharded);
    tp.group().all_reduce_sum(parts);
    total = total + parts;
  }
  return total.sqrt().item<double>();
}

std::map<std::string, double> AdamState::step(const std::vector<TrainableTensor>& tensors,
                                              const AdamParams& params, const dist::TensorParallel& tp) {
  params.validate();
  c10::NoGradGuard no_grad;
  const double grad_norm = global_grad_norm(tensors, tp);
  // torch.nn.utils.clip_grad_norm_: scale by max_norm / (norm + 1e-6), never up.
  double grad_scale = 1.0;
  if (params.grad_clip_norm > 0) grad_scale = std::min(1.0, params.grad_clip_norm / (grad_norm + 1e-6));

  ++step_;
  const double bias1 = 1.0 - std::pow(params.beta1, static_cast<double>(step_));
  const double bias2_sqrt = std::sqrt(1.0 - std::pow(params.beta2, static_cast<double>(step_)));
  const double step_size = params.learning_rate / bias1;
  // What the update runs on: the parameter itself when it is float32 and contiguous; a float32 contiguous copy
  // of a strided float32 one (LoRA B views), copied back; the float32 master of a lower-precision one (bf16
  // weights), cast back. So the update runs as a handful of multi-tensor kernels (torch.optim.AdamW's foreach
  // path) rather than ~8 launches per tensor, and no update is lost to the parameter's rounding.
  std::vector<at::Tensor> work, grads, exp_avgs, exp_avg_sqs;
  for (const auto& t : tensors) {
    auto [it, inserted] = moments_.try_emplace(t.name);
    if (inserted) {
      it->second = {at::zeros(t.param.sizes(), t.param.options().dtype(at::kFloat)),
                    at::zeros(t.param.sizes(), t.param.options().dtype(at::kFloat))};
    }
    exp_avgs.push_back(it->second.first);
    exp_avg_sqs.push_back(it->second.second);
    grads.push_back(t.grad.defined() ? t.grad.to(at::kFloat).contiguous() : at::zeros_like(it->second.first));
    if (t.param.scalar_type() == at::kFloat) {
      work.push_back(t.param.is_contiguous() ? t.param : t.param.contiguous());
    } else {
      auto [master, made] = masters_.try_emplace(t.name);
      if (made) master->second = t.param.to(at::kFloat).contiguous();  // a new tensor: never the parameter
      work.push_back(master->second);
    }
  }
  if (grad_scale != 1.0) grads = at::_foreach_mul(grads, grad_scale);  // never in place: grads are the model's
  // Same operation order as torch.optim.AdamW's single-tensor path (so CPU results match it bit for bit).
  if (params.weight_decay != 0.0) at::_foreach_mul_(work, 1.0 - params.learning_rate * params.weight_decay);
  at::_foreach_lerp_(exp_avgs, grads, 1.0 - params.beta1);
  at::_foreach_mul_(exp_avg_sqs, params.beta2);
  at::_foreach_addcmul_(exp_avg_sqs, grads, grads, 1.0 - params.beta2);
  std::vector<at::Tensor> denom = at::_foreach_sqrt(exp_avg_sqs);
  at::_foreach_div_(denom, bias2_sqrt);
  at::_foreach_add_(denom, params.eps);
  at::_foreach_addcdiv_(work, exp_avgs, denom, -step_size);
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!work[i].is_same(tensors[i].param)) tensors[i].param.copy_(work[i]);  // back into the model's tensor (cast)
  }
  return {{"grad_norm", grad_norm}, {"learning_rate", params.learning_rate}, {"step", static_cast<double>(step_)}};
}

}  // namespace skyrl_tx::optim
