// ExpertParallel: the group an MoE layer's experts are spread over, and the differentiable all-to-all that sends each
// token to the rank holding its expert when the ranks hold different tokens (data parallelism).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "dist/tensor_parallel.h"

namespace skyrl_tx::dist {

/// Rank r holds the contiguous experts experts_of(E, r): ceil(E / size) each, the last ranks fewer. Two layouts:
/// - over the tensor-parallel group: every rank has the same tokens; each runs its experts on them and the routed
///   outputs are summed (group().copy_in / reduce_out);
/// - over the data-parallel group: the ranks have the same tokens while sampling (every replica decodes the same
///   rows, as above) but different ones in a training pass. Inside a DistinctTokens scope, an MoE layer sends each
///   (token, expert) pair to the expert's rank and the output back (two all-to-alls per layer, two in backward;
///   GShard, Lepikhin et al. 2020), so no rank ever needs another's experts.
class ExpertParallel {
 public:
  ExpertParallel() = default;  // not split: every rank holds every expert
  ExpertParallel(TensorParallel group, bool over_data_parallel)
      : group_(std::move(group)), over_data_parallel_(over_data_parallel) {}

  bool enabled() const { return group_.enabled(); }
  const TensorParallel& group() const { return group_; }
  int rank() const { return group_.rank(); }
  int size() const { return group_.size(); }
  bool over_data_parallel() const { return over_data_parallel_; }
  Shard experts_of(int64_t num_experts, int rank) const { return group_.shard_of(num_experts, rank); }
  int owner_of(int64_t expert, int64_t num_experts) const {
    return static_cast<int>(expert / experts_of(num_experts, 0).length);
  }

  /// True inside a DistinctTokens scope: the ranks hold different tokens (a data-parallel training pass).
  bool distinct_tokens() const { return distinct_tokens_; }
  /// Marks a data-parallel pass for as long as it lives (the engine thread's; nothing else runs the model then).
  class DistinctTokens {
   public:
    explicit DistinctTokens(const ExpertParallel& ep) : ep_(ep), before_(ep.distinct_tokens_) {
      ep_.distinct_tokens_ = ep_.enabled() && ep_.over_data_parallel();
    }
    ~DistinctTokens() { ep_.distinct_tokens_ = before_; }
    DistinctTokens(const DistinctTokens&) = delete;
    DistinctTokens& operator=(const DistinctTokens&) = delete;

   private:
    const ExpertParallel& ep_;
    bool before_;
  };

  /// Rows of x [sum(send), ...]: send[r] of them to rank r, in rank order; returns [sum(recv), ...], recv[r] rows
  /// from rank r. Differentiable: the backward sends the gradient back the same way (the counts swapped).
  at::Tensor exchange(const at::Tensor& x, const std::vector<int64_t>& send, const std::vector<int64_t>& recv) const;
  /// counts [size * per_rank]: how many rows this rank sends to each expert, by global expert index padded to
  /// per_rank = experts_of(E, 0).length per rank. Returns [size * per_rank]: element s * per_rank + j is how many
  /// rows rank s sends to this rank's j-th expert. One all-to-all of the counts.
  std::vector<int64_t> exchange_counts(const std::vector<int64_t>& counts, at::Device device) const;

 private:
  TensorParallel group_;
  bool over_data_parallel_ = false;
  mutable bool distinct_tokens_ = false;
};

}  // namespace skyrl_tx::dist
