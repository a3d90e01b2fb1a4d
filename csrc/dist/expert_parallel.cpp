// ExpertParallel (see expert_parallel.h): the token exchange as an autograd function, and the counts' exchange.
#include "dist/expert_parallel.h"

#include <torch/csrc/autograd/custom_function.h>

#include "common/errors.h"

namespace skyrl_tx::dist {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

class Exchange : public torch::autograd::Function<Exchange> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, Collectives* group, std::vector<int64_t> send,
                            std::vector<int64_t> recv) {
    ctx->saved_data["group"] = reinterpret_cast<int64_t>(group);  // outlives the graph (the backend's)
    ctx->saved_data["send"] = send;
    ctx->saved_data["recv"] = recv;
    return group->all_to_all(x, send, recv);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto* group = reinterpret_cast<Collectives*>(ctx->saved_data["group"].toInt());
    // Every rank runs this for the same layer at the same point of its backward: the gradient of each row it
    // received goes back to the rank that sent it.
    at::Tensor back = group->all_to_all(grads[0].contiguous(), ctx->saved_data["recv"].toIntVector(),
                                        ctx->saved_data["send"].toIntVector());
    return {back, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor ExpertParallel::exchange(const at::Tensor& x, const std::vector<int64_t>& send,
                                    const std::vector<int64_t>& recv) const {
  SKYRL_TX_INTERNAL_ASSERT(enabled(), "expert exchange without an expert-parallel group");
  if (!x.requires_grad() || !at::GradMode::is_enabled()) return group_.group().all_to_all(x, send, recv);
  return Exchange::apply(x, &group_.group(), send, recv);
}

std::vector<int64_t> ExpertParallel::exchange_counts(const std::vector<int64_t>& counts, at::Device device) const {
  const int64_t ranks = size(), per_rank = static_cast<int64_t>(counts.size()) / ranks;
  SKYRL_TX_INTERNAL_ASSERT(per_rank * ranks == static_cast<int64_t>(counts.size()), "expert counts: not per rank");
  at::NoGradGuard no_grad;
  // [size * per_rank] on the model's device (an NCCL group moves device tensors only).
  at::Tensor mine = at::tensor(counts, at::TensorOptions().dtype(at::kLong)).to(device);
  const std::vector<int64_t> each(ranks, per_rank);
  at::Tensor theirs = group_.group().all_to_all(mine, each, each).cpu();  // [size * per_rank]
  return {theirs.data_ptr<int64_t>(), theirs.data_ptr<int64_t>() + theirs.numel()};
}

}  // namespace skyrl_tx::dist
