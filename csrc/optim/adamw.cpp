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

double global_grad_norm(const std::vector<TrainableTensor>& tensors) {
  double total = 0.0;
  for (const auto& t : tensors) {
    if (t.grad.defined()) total += t.grad.to(at::kDouble).pow(2).sum().item<double>();
  }
  return std::sqrt(total);
}

std::map<std::string, double> AdamState::step(const std::vector<TrainableTensor>& tensors,
                                              const AdamParams& params) {
  params.validate();
  c10::NoGradGuard no_grad;
  const double grad_norm = global_grad_norm(tensors);
  // torch.nn.utils.clip_grad_norm_: scale by max_norm / (norm + 1e-6), never up.
  double grad_scale = 1.0;
  if (params.grad_clip_norm > 0) grad_scale = std::min(1.0, params.grad_clip_norm / (grad_norm + 1e-6));

  ++step_;
  const double bias1 = 1.0 - std::pow(params.beta1, static_cast<double>(step_));
  const double bias2_sqrt = std::sqrt(1.0 - std::pow(params.beta2, static_cast<double>(step_)));
  const double step_size = params.learning_rate / bias1;
  for (const auto& t : tensors) {
    auto [it, inserted] = moments_.try_emplace(t.name);
    if (inserted) it->second = {at::zeros_like(t.param, at::kFloat), at::zeros_like(t.param, at::kFloat)};
    auto& [exp_avg, exp_avg_sq] = it->second;
    at::Tensor grad = t.grad.defined() ? t.grad.to(at::kFloat) : at::zeros_like(exp_avg);
    if (grad_scale != 1.0) grad = grad * grad_scale;
    // Same operation order as torch.optim.AdamW's single-tensor path.
    at::Tensor param = t.param.to(at::kFloat);
    param.mul_(1.0 - params.learning_rate * params.weight_decay);
    exp_avg.lerp_(grad, 1.0 - params.beta1);
    exp_avg_sq.mul_(params.beta2).addcmul_(grad, grad, 1.0 - params.beta2);
    at::Tensor denom = (exp_avg_sq.sqrt() / bias2_sqrt).add_(params.eps);
    param.addcdiv_(exp_avg, denom, -step_size);
    if (!param.is_same(t.param)) t.param.copy_(param);  // bf16 params: the update is computed in float32
  }
  return {{"grad_norm", grad_norm}, {"learning_rate", params.learning_rate}, {"step", static_cast<double>(step_)}};
}

}  // namespace skyrl_tx::optim
