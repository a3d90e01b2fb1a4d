// ZeroAdamState: AdamW for a data-parallel full fine-tune with ZeRO-2 sharding (see zero_adamw.h).
#include "optim/zero_adamw.h"

#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>

#include "common/errors.h"

namespace skyrl_tx::optim {

ZeroAdamState::ZeroAdamState(const std::vector<TrainableTensor>& tensors, const dist::Collectives& group,
                             int64_t bucket_elements)
    : rank_(group.rank()), world_(group.world_size()) {
  SKYRL_TX_CHECK(!tensors.empty(), InvalidArgument, "ZeRO optimizer: the model has no trainable tensors");
  SKYRL_TX_CHECK(bucket_elements >= 1, InvalidArgument, "ZeRO optimizer: bucket_elements must be >= 1");
  for (const auto& t : tensors) {
    names_.push_back(t.name);
    shapes_.push_back(t.param.sizes().vec());
    offsets_.push_back(total_);
    total_ += t.param.numel();
    keeps_master_ = keeps_master_ || t.param.scalar_type() != at::kFloat;
  }
  // One bucket when the model fits one (no padding beyond a partial last part), else full buckets of
  // world * B <= bucket_elements; the last bucket ends in padding (zeros that stay zero).
  part_ = total_ <= bucket_elements ? (total_ + world_ - 1) / world_ : std::max<int64_t>(1, bucket_elements / world_);
  buckets_ = (total_ + world_ * part_ - 1) / (world_ * part_);
  float_options_ = tensors.front().param.options().dtype(at::kFloat);
}

template <typename Visit>
void ZeroAdamState::for_each_piece(int64_t begin, int64_t length, Visit visit) const {
  const int64_t end = begin + length;
  // The first tensor that ends after `begin` (offsets_ ascend).
  size_t i = std::upper_bound(offsets_.begin(), offsets_.end(), begin) - offsets_.begin();
  i = i == 0 ? 0 : i - 1;
  for (; i < offsets_.size() && offsets_[i] < end; ++i) {
    const int64_t numel = c10::multiply_integers(shapes_[i]);
    const int64_t from = std::max(begin, offsets_[i]), to = std::min(end, offsets_[i] + numel);
    if (from < to) visit(i, from - offsets_[i], from - begin, to - from);
  }
}

at::Tensor ZeroAdamState::my_range(const std::vector<at::Tensor>& full) const {
  at::Tensor out = at::zeros({buckets_ * part_}, float_options_);  // [S]
  for (int64_t b = 0; b < buckets_; ++b) {
    at::Tensor part = out.narrow(0, b * part_, part_);  // [B]
    for_each_piece((b * world_ + rank_) * part_, part_, [&](size_t i, int64_t in_tensor, int64_t in_part, int64_t n) {
      if (full[i].defined()) part.narrow(0, in_part, n).copy_(full[i].reshape({-1}).narrow(0, in_tensor, n));
    });
  }
  return out;
}

at::Tensor ZeroAdamState::global_squares(const at::Tensor& grads, const std::vector<TrainableTensor>& tensors,
                                         dist::Collectives& group, const dist::TensorParallel& tp) const {
  if (!tp.enabled()) {
    at::Tensor squares = grads.to(at::kDouble).pow(2).sum().reshape({1});  // [1] this range's share of the norm²
    group.all_reduce_sum(squares);
    return squares;
  }
  // The split tensors' squares from every tensor-parallel rank (each holds a different part); a replicated tensor's
  // from tensor-parallel rank 0 only (every rank holds all of it).
  at::Tensor squares = at::zeros({1}, grads.options().dtype(at::kDouble));  // [1]
  for (int64_t b = 0; b < buckets_; ++b) {
    for_each_piece((b * world_ + rank_) * part_, part_, [&](size_t i, int64_t, int64_t in_part, int64_t n) {
      if (!tensors[i].split.replicated() || tp.rank() == 0) {
        squares += grads.narrow(0, b * part_ + in_part, n).to(at::kDouble).pow(2).sum();
      }
    });
  }
  group.all_reduce_sum(squares);
  tp.group().all_reduce_sum(squares);
  return squares;
}

template <typename Write>
void ZeroAdamState::gather_buckets(const at::Tensor& range, dist::Collectives& group, Write write) const {
  for (int64_t b = 0; b < buckets_; ++b) {
    at::Tensor gathered = group.all_gather(range.narrow(0, b * part_, part_).contiguous());  // [W * B]
    write(b * world_ * part_, gathered);
  }
}

std::map<std::string, at::Tensor> ZeroAdamState::gather_named(const at::Tensor& range,
                                                              dist::Collectives& group) const {
  std::map<std::string, at::Tensor> out;
  std::vector<at::Tensor> flat;
  for (size_t i = 0; i < names_.size(); ++i) {
    out[names_[i]] = at::empty(shapes_[i], at::kFloat);
    flat.push_back(out[names_[i]].view({-1}));
  }
  gather_buckets(range, group, [&](int64_t begin, const at::Tensor& gathered) {
    at::Tensor host = gathered.to(at::kCPU, at::kFloat);
    for_each_piece(begin, host.numel(), [&](size_t i, int64_t in_tensor, int64_t in_bucket, int64_t n) {
      flat[i].narrow(0, in_tensor, n).copy_(host.narrow(0, in_bucket, n));
    });
  });
  return out;
}

at::Tensor ZeroAdamState::reduce_scatter(const std::vector<at::Tensor>& grads, dist::Collectives& group) const {
  SKYRL_TX_CHECK(grads.size() == names_.size(), Internal, "ZeRO optimizer: ", grads.size(),
                 " gradients for a layout of ", names_.size(), " tensors");
  c10::NoGradGuard no_grad;
  at::Tensor out = at::empty({buckets_ * part_}, float_options_);  // [S]
  at::Tensor bucket = at::empty({world_ * part_}, float_options_);   // [W * B] reused: one bucket at a time
  for (int64_t b = 0; b < buckets_; ++b) {
    bucket.zero_();
    for_each_piece(b * world_ * part_, world_ * part_, [&](size_t i, int64_t in_tensor, int64_t in_bucket, int64_t n) {
      if (grads[i].defined()) bucket.narrow(0, in_bucket, n).copy_(grads[i].reshape({-1}).narrow(0, in_tensor, n));
    });
    out.narrow(0, b * part_, part_).copy_(group.reduce_scatter_sum(bucket));  // this rank's part [B]
  }
  return out;
}

void ZeroAdamState::add_pending(at::Tensor batch) {
  if (pending_.defined()) batch.add_(pending_);
  pending_ = std::move(batch);
}

std::map<std::string, double> ZeroAdamState::step(const std::vector<TrainableTensor>& tensors,
                                                  const AdamParams& params, dist::Collectives& group,
                                                  const dist::TensorParallel& tp) {
  params.validate();  // before any collective: every rank refuses the same call the same way
  SKYRL_TX_CHECK(tensors.size() == names_.size(), Internal, "ZeRO optimizer: ", tensors.size(),
                 " tensors for a layout of ", names_.size());
  c10::NoGradGuard no_grad;
  at::Tensor grads = pending_.defined() ? pending_ : at::zeros({buckets_ * part_}, float_options_);  // [S]
  const double grad_norm = std::sqrt(global_squares(grads, tensors, group, tp).item<double>());
  double grad_scale = 1.0;  // torch.nn.utils.clip_grad_norm_, as AdamState
  if (params.grad_clip_norm > 0) grad_scale = std::min(1.0, params.grad_clip_norm / (grad_norm + 1e-6));

  ++step_;
  const double bias1 = 1.0 - std::pow(params.beta1, static_cast<double>(step_));
  const double bias2_sqrt = std::sqrt(1.0 - std::pow(params.beta2, static_cast<double>(step_)));
  const double step_size = params.learning_rate / bias1;
  std::vector<at::Tensor> weights;
  for (const auto& t : tensors) weights.push_back(t.param);
  // [S] float32: this rank's master weights (made from the weights at the first step), updated in place, or, for
  // float32 weights, a copy of its range of them.
  if (keeps_master_ && !master_.defined()) master_ = my_range(weights);
  at::Tensor work = keeps_master_ ? master_ : my_range(weights);
  if (!exp_avg_.defined()) {
    exp_avg_ = at::zeros({buckets_ * part_}, float_options_);  // [S]
    exp_avg_sq_ = at::zeros_like(exp_avg_);
  }
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
  // copy back into the model makes). The master keeps the float32 values.
  const at::ScalarType dtype = tensors.front().param.scalar_type();
  const bool one_dtype = std::all_of(tensors.begin(), tensors.end(),
                                     [&](const TrainableTensor& t) { return t.param.scalar_type() == dtype; });
  std::vector<at::Tensor> flat;
  for (const auto& t : tensors) flat.push_back(t.param.view({-1}));
  gather_buckets(work.to(one_dtype ? dtype : at::kFloat), group, [&](int64_t begin, const at::Tensor& gathered) {
    for_each_piece(begin, gathered.numel(), [&](size_t i, int64_t in_tensor, int64_t in_bucket, int64_t n) {
      flat[i].narrow(0, in_tensor, n).copy_(gathered.narrow(0, in_bucket, n));
    });
  });
  return {{"grad_norm", grad_norm}, {"learning_rate", params.learning_rate}, {"step", static_cast<double>(step_)}};
}

std::map<std::string, std::pair<at::Tensor, at::Tensor>> ZeroAdamState::gather_moments(
    dist::Collectives& group) const {
  std::map<std::string, std::pair<at::Tensor, at::Tensor>> out;
  if (!exp_avg_.defined()) return out;  // the same on every rank: they step together
  std::map<std::string, at::Tensor> m = gather_named(exp_avg_, group);
  std::map<std::string, at::Tensor> v = gather_named(exp_avg_sq_, group);
  for (const auto& name : names_) out[name] = {m.at(name), v.at(name)};
  return out;
}

std::map<std::string, at::Tensor> ZeroAdamState::gather_pending(dist::Collectives& group) const {
  if (!pending_.defined()) {  // the same on every rank: they commit batches together
    std::map<std::string, at::Tensor> zeros;
    for (size_t i = 0; i < names_.size(); ++i) zeros[names_[i]] = at::zeros(shapes_[i], at::kFloat);
    return zeros;
  }
  return gather_named(pending_, group);
}

std::map<std::string, at::Tensor> ZeroAdamState::gather_masters(dist::Collectives& group) const {
  if (!master_.defined()) return {};  // the same on every rank: they step, restore and load weights together
  return gather_named(master_, group);
}

void ZeroAdamState::restore(int64_t step, const std::map<std::string, std::pair<at::Tensor, at::Tensor>>& moments,
                            const std::map<std::string, at::Tensor>& masters) {
  step_ = step;
  master_ = at::Tensor();
  if (keeps_master_ && !masters.empty()) {
    std::vector<at::Tensor> full;
    for (const auto& name : names_) full.push_back(masters.at(name));
    master_ = my_range(full);
  }
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
  for (const at::Tensor* t : {&pending_, &exp_avg_, &exp_avg_sq_, &master_}) {
    bytes += t->defined() ? int64_t(t->nbytes()) : 0;
  }
  return bytes;
}

}  // namespace skyrl_tx::optim
