// Dimuon: momentum, then Newton–Schulz orthogonalisation of each LoRA factor's update (Muon for LoRA).
#include "optim/dimuon.h"

#include <c10/core/GradMode.h>

#include <cmath>
#include <utility>

#include "common/errors.h"

namespace skyrl_tx::optim {

void DimuonParams::validate() const {
  SKYRL_TX_CHECK(std::isfinite(learning_rate) && learning_rate >= 0, InvalidArgument,
                 "optim_step: optimizer_params.learning_rate must be a finite number >= 0 (got ", learning_rate, ")");
  SKYRL_TX_CHECK(std::isfinite(beta1) && beta1 >= 0 && beta1 < 1, InvalidArgument,
                 "optim_step: optimizer_params.beta1 must be in [0, 1) (got ", beta1, ")");
  SKYRL_TX_CHECK(std::isfinite(grad_clip_norm), InvalidArgument,
                 "optim_step: optimizer_params.grad_clip_norm must be finite (got ", grad_clip_norm,
                 "); <= 0 disables clipping");
}

at::Tensor newton_schulz(const at::Tensor& x) {
  SKYRL_TX_CHECK(x.dim() == 3 && x.size(1) <= x.size(2), InvalidArgument,
                 "newton_schulz: expects [n, r, k] with r <= k, got ", x.sizes());
  at::Tensor X = x.to(at::kFloat);
  X = X / (at::linalg_vector_norm(X, 2, at::IntArrayRef{1, 2}, /*keepdim=*/true) + kNewtonSchulzEps);
  for (int i = 0; i < kNewtonSchulzSteps; ++i) {
    const at::Tensor gram = at::matmul(X, X.transpose(1, 2));                        // [n, r, r]
    const at::Tensor poly = kNewtonSchulzB * gram + kNewtonSchulzC * at::matmul(gram, gram);  // [n, r, r]
    X = kNewtonSchulzA * X + at::matmul(poly, X);                                     // [n, r, k]
  }
  return X;
}

std::map<std::string, double> DimuonState::step(const std::vector<TrainableTensor>& tensors,
                                                const DimuonParams& params, const dist::TensorParallel& tp) {
  params.validate();
  for (const auto& t : tensors) {
    SKYRL_TX_CHECK(t.param.dim() == 2, InvalidArgument, "optim_step: dimuon updates matrices; '", t.name,
                   "' has shape ", t.param.sizes());
  }
  c10::NoGradGuard no_grad;
  const double grad_norm = global_grad_norm(tensors, tp);
  double grad_scale = 1.0;  // torch.nn.utils.clip_grad_norm_, as AdamW: max_norm / (norm + 1e-6), never up
  if (params.grad_clip_norm > 0) grad_scale = std::min(1.0, params.grad_clip_norm / (grad_norm + 1e-6));
  ++step_;
  // Momentum update, then the matrices to orthogonalise (each r × k with r <= k), grouped by shape so every
  // group runs as one batched Newton–Schulz (a model's q/k/v/... factors share a few shapes).
  std::map<std::pair<int64_t, int64_t>, std::vector<size_t>> groups;
  std::vector<at::Tensor> oriented(tensors.size());
  std::vector<bool> transposed(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    auto [it, inserted] = momentum_.try_emplace(t.name);
    if (inserted) it->second = at::zeros(t.param.sizes(), t.param.options().dtype(at::kFloat));
    if (t.grad.defined()) {
      at::Tensor g = t.grad.to(at::kFloat);
      if (grad_scale != 1.0) g = g * grad_scale;  // never in place: the gradient is the model's
      it->second.lerp_(g, 1.0 - params.beta1);  // m ← β1·m + (1−β1)·g
    } else {
      it->second.mul_(params.beta1);  // no gradient = a zero gradient
    }
    // The whole momentum (every rank, the tensors' order: a collective for a split factor).
    const at::Tensor whole = tp.enabled() ? tp.whole(it->second, t.split) : it->second;  // [out, in] of one process
    transposed[i] = whole.size(0) > whole.size(1);
    oriented[i] = transposed[i] ? whole.t() : whole;
    groups[{oriented[i].size(0), oriented[i].size(1)}].push_back(i);
  }
  for (const auto& [shape, members] : groups) {
    std::vector<at::Tensor> batch;
    for (size_t i : members) batch.push_back(oriented[i]);
    const at::Tensor ortho = newton_schulz(at::stack(batch));  // [n, r, k]
    for (size_t j = 0; j < members.size(); ++j) {
      const size_t i = members[j];
      at::Tensor direction = transposed[i] ? ortho[j].t() : ortho[j];
      if (tp.enabled()) direction = tp.part(direction, tensors[i].split, tensors[i].param.sizes());  // this rank's
      at::Tensor work = tensors[i].param.to(at::kFloat);  // the parameter itself when already float32
      work.sub_(direction, params.learning_rate);
      if (!work.is_same(tensors[i].param)) tensors[i].param.copy_(work);
    }
  }
  return {{"grad_norm", grad_norm}, {"learning_rate", params.learning_rate}, {"step", static_cast<double>(step_)}};
}

}  // namespace skyrl_tx::optim
