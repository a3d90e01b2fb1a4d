// ZeroAdamState: AdamW for a data-parallel full fine-tune with ZeRO-2 sharding (see zero_adamw.h).
#include "optim/zero_adamw.h"

#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>

#include "common/errors.h"

namespace skyrl_tx::optim {

ZeroAdamState::ZeroAdamState(const std::vector<TrainableTensor>& tensors, const dist::Collectives& group)
    : rank_(group.rank()), world_(group.world_size()) {
  SKYRL_TX_CHECK(!tensors.empty(), InvalidArgument, "ZeRO optimizer: the model has no trainable tensors");
  for (const auto& t : tensors) {
    names_.push_back(t.name);
    shapes_.push_back(t.param.sizes().vec());
    offsets_.push_back(total_);
    total_ += t.param.numel();
  }
  shard_ = (total_ + world_ - 1) / world_;  // the last rank's range ends in padding (zeros that stay zero)
  float_options_ = tensors.front().param.options().dtype(at::kFloat);
}

at::Tensor ZeroAdamState::my_range(const std::vector<at::Tensor>& full) const {
  at::Tensor out = at::zeros({shard_}, float_options_);  // [S]
  const int64_t lo = rank_ * shard_, hi = lo + shard_;
  for (size_t i = 0; i < full.size(); ++i) {
    if (!full[i].defined()) continue;  // no gradient: zeros
    const int64_t begin = std::max(lo, offsets_[i]), end = std::min(hi, offsets_[i] + full[i].numel());
    if (begin >= end) continue;
    out.narrow(0, begin - lo, end - begin).copy_(full[i].reshape({-1}).narrow(0, begin - offsets_[i], end - begin));
  }
  return out;
}

std::map<std::string, at::Tensor> ZeroAdamState::split(const at::Tensor& gathered) const {
  std::map<std::string, at::Tensor> out;
  for (size_t i = 0; i < names_.size(); ++i) {
    const int64_t numel = c10::multiply_integers(shapes_[i]);
    out[names_[i]] = gathered.narrow(0, offsets_[i], numel).reshape(shapes_[i]).to(at::kCPU, at::kFloat, false, true);
  }
  return out;
}

at::Tensor ZeroAdamState::reduce_scatter(const std::vector<at::Tensor>& grads, dist::Collectives& group) const {
  SKYRL_TX_CHECK(grads.size() == names_.size(), Internal, "ZeRO optimizer: ", grads.size(),
                 " gradients for a layout of ", names_.size(), " tensors");
  c10::NoGradGuard no_grad;
  at::Tensor flat = at::zeros({shard_ * world_}, float_options_);  // [W * S] this rank's batch gradients
  for (size_t i = 0; i < grads.size(); ++i) {
    if (grads[i].defined()) flat.narrow(0, offsets_[i], grads[i].numel()).copy_(grads[i].reshape({-1}));
  }
  return group.reduce_scatter_sum(flat);  // [S]
}

void ZeroAdamState::add_pending(at::Tensor batch) {
  if (pending_.defined()) batch.add_(pending_);
  pending_ = std::move(batch);
}

std::map<std::string, double> ZeroAdamState::step(const std::vector<TrainableTensor>& tensors,
                                                  const AdamParams& params, dist::Collectives& group) {
  params.validate();  // before any collective: every rank refuses the same call the same way
  SKYRL_TX_CHECK(tensors.size() == names_.size(), Internal, "ZeRO optimizer: ", tensors.size(),
                 " tensors for a layout of ", names_.size());
  c10::NoGradGuard no_grad;
  at::Tensor grads = pending_.defined() ? pending_ : at::zeros({shard_}, float_options_);  // [S]
  at::Tensor squares = grads.to(at::kDouble).pow(2).sum().reshape({1});  // [1] this range's share of the norm²
  group.all_reduce_sum(squares);
  const double grad_norm = std::sqrt(squares.item<double>());
  double grad_scale = 1.0;  // torch.nn.utils.clip_grad_norm_, as AdamState
  if (params.grad_clip_norm > 0) grad_scale = std::min(1.0, params.grad_clip_norm / (grad_norm + 1e-6));

  ++step_;
  const double bias1 = 1.0 - std::pow(params.beta1, static_cast<double>(step_));
  const double bias2_sqrt = std::sqrt(1.0 - std::pow(params.beta2, static_cast<double>(step_)));
  const double step_size = params.learning_rate / bias1;
  std::vector<at::Tensor> weights;
  for (const auto& t : tensors) weights.push_back(t.param);
  at::Tensor work = my_range(weights);  // [S] float32 copy of this rank's weights
  if (!exp_avg_.defined()) exp_avg_ = at::zeros({shard_}, float_options_), exp_avg_sq_ = at::zeros_like(exp_avg_);
  if (grad_scale != 1.0) grads = grads * grad_scale;
  // AdamState's operation order, on one tensor.
  if (params.weight_decay != 0.0) work.mul_(1.0 - params.learning_rate * params.weight_decay);
  exp_avg_.lerp_(grads, 1.0 - params.beta1);
  exp_avg_sq_.mul_(params.beta2).addcmul_(grads, grads, 1.0 - params.beta2);
  at::Tensor denom = exp_avg_sq_.sqrt();
  denom.div_(bias2_sqrt).add_(params.eps);
  work.addcdiv_(exp_avg_, denom, -step_size);
  pending_ = at::Tensor();

  // Every rank's updated range, in the weights' dtype (half the bytes for bf16; the cast is the one AdamState's
  // copy back into the model makes).
  const at::ScalarType dtype = tensors.front().param.scalar_type();
  const bool one_dtype = std::all_of(tensors.begin(), tensors.end(),
                                     [&](const TrainableTensor& t) { return t.param.scalar_type() == dtype; });
  at::Tensor gathered = group.all_gather(work.to(one_dtype ? dtype : at::kFloat));  // [W * S]
  for (size_t i = 0; i < tensors.size(); ++i) {
    tensors[i].param.copy_(gathered.narrow(0, offsets_[i], tensors[i].param.numel()).view(tensors[i].param.sizes()));
  }
  return {{"grad_norm", grad_norm}, {"learning_rate", params.learning_rate}, {"step", static_cast<double>(step_)}};
}

std::map<std::string, std::pair<at::Tensor, at::Tensor>> ZeroAdamState::gather_moments(
    dist::Collectives& group) const {
  std::map<std::string, std::pair<at::Tensor, at::Tensor>> out;
  if (!exp_avg_.defined()) return out;  // the same on every rank: they step together
  at::Tensor both = group.all_gather(at::cat({exp_avg_, exp_avg_sq_}));  // [W * 2S]: rank by rank, m then v
  at::Tensor by_rank = both.view({world_, 2, shard_});
  std::map<std::string, at::Tensor> m = split(by_rank.select(1, 0).reshape({-1}));
  std::map<std::string, at::Tensor> v = split(by_rank.select(1, 1).reshape({-1}));
  for (const auto& name : names_) out[name] = {m.at(name), v.at(name)};
  return out;
}

std::map<std::string, at::Tensor> ZeroAdamState::gather_pending(dist::Collectives& group) const {
  if (!pending_.defined()) {  // the same on every rank: they commit batches together
    std::map<std::string, at::Tensor> zeros;
    for (size_t i = 0; i < names_.size(); ++i) zeros[names_[i]] = at::zeros(shapes_[i], at::kFloat);
    return zeros;
  }
  return split(group.all_gather(pending_));
}

void ZeroAdamState::restore(int64_t step, const std::map<std::string, std::pair<at::Tensor, at::Tensor>>& moments) {
  step_ = step;
  if (moments.empty()) {
    exp_avg_ = exp_avg_sq_ = at::Tensor();
    return;
  }
  std::vector<at::Tensor> m, v;
  for (const auto& name : names_) {
    m.push_back(moments.at(name).first);
    v.push_back(moments.at(name).second);
  }
  exp_avg_ = my_range(m);
  exp_avg_sq_ = my_range(v);
}

int64_t ZeroAdamState::local_bytes() const {
  int64_t bytes = 0;
  for (const at::Tensor* t : {&pending_, &exp_avg_, &exp_avg_sq_}) bytes += t->defined() ? int64_t(t->nbytes()) : 0;
  return bytes;
}

}  // namespace skyrl_tx::optim
