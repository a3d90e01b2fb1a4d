// TensorParallel (see tensor_parallel.h): shards and the f/g collectives as autograd functions.
#include "dist/tensor_parallel.h"

#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>

#include "common/errors.h"

namespace skyrl_tx::dist {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

Collectives* group_of(AutogradContext* ctx) {
  return reinterpret_cast<Collectives*>(ctx->saved_data["group"].toInt());  // outlives the graph (the backend's)
}

at::Tensor summed(const at::Tensor& x, Collectives& group) {
  at::Tensor out = x.contiguous().clone();  // the collective writes in place; the input may be saved elsewhere
  group.all_reduce_sum(out);
  return out;
}

class CopyIn : public torch::autograd::Function<CopyIn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, Collectives* group) {
    ctx->saved_data["group"] = reinterpret_cast<int64_t>(group);
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {summed(grads[0], *group_of(ctx)), at::Tensor()};
  }
};

class ReduceOut : public torch::autograd::Function<ReduceOut> {
 public:
  static at::Tensor forward(AutogradContext* /*ctx*/, const at::Tensor& x, Collectives* group) {
    return summed(x, *group);
  }
  static variable_list backward(AutogradContext* /*ctx*/, variable_list grads) { return {grads[0], at::Tensor()}; }
};

}  // namespace

Collectives& TensorParallel::group() const {
  SKYRL_TX_INTERNAL_ASSERT(group_ != nullptr, "tensor parallel: no group");
  return *group_;
}

Shard TensorParallel::shard_of(int64_t n, int rank) const {
  const int64_t per_rank = (n + size() - 1) / size();
  const int64_t begin = std::min(n, per_rank * rank);
  return {begin, std::min(n, begin + per_rank) - begin};
}

at::Tensor TensorParallel::narrow(const at::Tensor& full, int64_t dim) const {
  if (!enabled()) return full;
  const Shard s = shard(full.size(dim));
  return full.narrow(dim, s.begin, s.length).contiguous().clone();
}

at::Tensor TensorParallel::copy_in(const at::Tensor& x) const {
  if (!enabled()) return x;
  return CopyIn::apply(x, group_.get());
}

at::Tensor TensorParallel::reduce_out(const at::Tensor& x) const {
  if (!enabled()) return x;
  return ReduceOut::apply(x, group_.get());
}

at::Tensor TensorParallel::max(const at::Tensor& x) const {
  if (!enabled()) return x;
  at::NoGradGuard no_grad;
  at::Tensor out = x.contiguous().clone();
  group_->all_reduce_max(out);
  return out;
}

at::Tensor TensorParallel::gather(const at::Tensor& local, int64_t dim, int64_t n) const {
  if (!enabled()) return local;
  at::NoGradGuard no_grad;
  const Shard mine = shard(n);
  SKYRL_TX_INTERNAL_ASSERT(local.size(dim) == mine.length, "tensor parallel gather: not this rank's shard");
  const int64_t per_rank = shard_of(n, 0).length;
  // Every rank sends the same number of elements: its shard moved to the front and padded to per_rank rows.
  at::Tensor front = local.movedim(dim, 0);  // [length, rest...]
  std::vector<int64_t> padded_shape(front.sizes().begin(), front.sizes().end());
  padded_shape[0] = per_rank;
  at::Tensor padded = at::zeros(padded_shape, local.options());  // [per_rank, rest...]
  padded.narrow(0, 0, mine.length).copy_(front);
  at::Tensor all = group_->all_gather(padded.reshape({-1}));  // [size * per_rank * rest]
  padded_shape.insert(padded_shape.begin(), size());
  at::Tensor stacked = all.view(padded_shape);  // [size, per_rank, rest...]
  std::vector<at::Tensor> parts;
  for (int r = 0; r < size(); ++r) parts.push_back(stacked.select(0, r).narrow(0, 0, shard_of(n, r).length));
  return at::cat(parts, 0).movedim(0, dim).contiguous();  // the full tensor, `dim` of size n
}

at::Tensor TensorParallel::narrow_sections(const at::Tensor& full, int64_t dim,
                                           const std::vector<int64_t>& sections) const {
  if (!enabled()) return full;
  std::vector<at::Tensor> parts;
  int64_t start = 0;
  for (int64_t n : sections) {
    const Shard s = shard(n);
    parts.push_back(full.narrow(dim, start + s.begin, s.length));
    start += n;
  }
  SKYRL_TX_INTERNAL_ASSERT(start == full.size(dim), "tensor parallel: sections do not cover the dimension");
  return at::cat(parts, dim).contiguous();
}

at::Tensor TensorParallel::whole(const at::Tensor& local, const TensorSplit& split) const {
  if (!enabled() || split.replicated()) return local.detach();
  if (split.dim >= 0 && !split.sections.empty()) {  // each section gathered on its own, then laid end to end
    std::vector<at::Tensor> wholes;
    int64_t start = 0;
    for (int64_t n : split.sections) {
      const int64_t length = shard(n).length;
      wholes.push_back(gather(local.detach().narrow(split.dim, start, length), split.dim, n));
      start += length;
    }
    return at::cat(wholes, split.dim);
  }
  if (split.dim >= 0) return gather(local.detach(), split.dim, split.whole_shape.at(split.dim));
  at::NoGradGuard no_grad;
  at::Tensor buffer = rank() == split.owner ? local.detach().contiguous().clone()
                                            : at::empty(split.whole_shape, local.options());
  group_->broadcast(buffer, split.owner);
  return buffer;
}

at::Tensor TensorParallel::part(const at::Tensor& whole, const TensorSplit& split, at::IntArrayRef local_shape) const {
  if (!enabled() || split.replicated()) return whole;
  if (split.dim >= 0 && !split.sections.empty()) return narrow_sections(whole, split.dim, split.sections);
  if (split.dim >= 0) return narrow(whole, split.dim);
  return rank() == split.owner ? whole : at::empty(local_shape, whole.options());
}

}  // namespace skyrl_tx::dist
