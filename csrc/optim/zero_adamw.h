// ZeroAdamState: AdamW for a data-parallel full fine-tune with ZeRO-2 sharding (gradients and moments sharded).
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "dist/collectives.h"
#include "dist/tensor_parallel.h"
#include "optim/adamw.h"

namespace skyrl_tx::optim {

/// The model's stepped tensors are laid end to end in one index space of `total` elements, cut into buckets of
/// world_size * B elements (the last one padded); rank r owns part r, elements [r * B, (r + 1) * B), of every
/// bucket: its range is those parts, S = buckets * B elements. Collectives run bucket by bucket, so sharding a
/// model adds one bucket of float32, not a whole-model copy. A rank keeps, for its range only: the gradients
/// summed over the ranks (reduce-scattered after every batch, accumulated until optim_step) and the two AdamW
/// moments; it updates its range, then every rank all-gathers the updated weights, so every rank still holds the
/// whole model for its forward passes. Per rank: the weights plus (gradients + 2 moments) / world_size in float32,
/// instead of the weights plus 3 full float32 copies. Same arithmetic as AdamState, element for element (the
/// global grad norm is summed in another order: equal to ~1e-7 relative).
/// Master weights: when any stepped tensor is stored below float32 (bf16 full fine-tuning), the rank also keeps a
/// float32 master of its range, beside the moments: the step updates it and all-gathers its cast, so updates
/// below half an ulp of bf16 accumulate (AdamState's masters, sharded). Float32 weights need none.
/// Every rank calls every collective method in the same order with the same tensors (names and shapes).
class ZeroAdamState {
 public:
  /// The layout of `tensors` (one model's stepped tensors, the same on every rank) over `group`'s ranks, with
  /// buckets of at most `bucket_elements` (all ranks' parts together; one bucket when the model is smaller).
  ZeroAdamState(const std::vector<TrainableTensor>& tensors, const dist::Collectives& group, int64_t bucket_elements);

  /// One batch's gradients (each tensor's .grad; undefined = zeros), summed over the ranks: this rank's range
  /// [S], float32. Collective. The caller adds it with add_pending once the whole batch has succeeded.
  at::Tensor reduce_scatter(const std::vector<at::Tensor>& grads, dist::Collectives& group) const;
  /// The gradients pending for the next step (this rank's range; undefined = none yet).
  const at::Tensor& pending() const { return pending_; }
  /// pending += batch (into `batch`'s buffer, so the old pending tensor is never written: cannot fail halfway).
  void add_pending(at::Tensor batch);
  void drop_pending() { pending_ = at::Tensor(); }

  /// Clips (if asked) by the global norm of the pending gradients, steps this rank's range, all-gathers the new
  /// weights into `tensors` (every rank's copies), drops the pending gradients. Collective. Returns AdamState's
  /// metrics. `tensors` in the layout's order. Under tensor parallelism (`group` then holds the ranks with the same
  /// part, and `tensors` are this rank's parts), the norm also sums the other parts, each replicated tensor once.
  std::map<std::string, double> step(const std::vector<TrainableTensor>& tensors, const AdamParams& params,
                                     dist::Collectives& group,
                                     const dist::TensorParallel& tp = dist::kNoTensorParallel);

  int64_t num_steps() const { return step_; }
  /// Full moments by tensor name, as float32 CPU tensors (empty before the first step). Collective.
  std::map<std::string, std::pair<at::Tensor, at::Tensor>> gather_moments(dist::Collectives& group) const;
  /// The pending gradients of every tensor by name, as float32 CPU tensors (zeros when none). Collective.
  std::map<std::string, at::Tensor> gather_pending(dist::Collectives& group) const;
  /// Full float32 master weights of every layout tensor by name, as CPU tensors (empty when this state keeps none:
  /// float32 weights, or before the first step / after drop_master). Collective.
  std::map<std::string, at::Tensor> gather_masters(dist::Collectives& group) const;
  /// Replaces the state with full moments by name (a checkpoint; empty: none yet): keeps this rank's range.
  /// `masters`: empty (rebuilt from the weights at the next step) or full float32 masters of every layout tensor,
  /// each rounding to its weight. The caller has checked names and shapes.
  void restore(int64_t step, const std::map<std::string, std::pair<at::Tensor, at::Tensor>>& moments,
               const std::map<std::string, at::Tensor>& masters = {});
  /// Forgets the master range (the weights were overwritten): the next step rebuilds it from the weights.
  void drop_master() { master_ = at::Tensor(); }
  /// Bytes of optimizer state this rank holds: pending gradients, moments and master weights (its range only).
  int64_t local_bytes() const;

 private:
  /// Calls visit(tensor index, offset in that tensor, offset in [begin, begin + length), count) for every piece of
  /// the layout's tensors inside the flat range [begin, begin + length).
  template <typename Visit>
  void for_each_piece(int64_t begin, int64_t length, Visit visit) const;
  /// Layout tensors (any dtype; undefined = zeros) → this rank's [S] range as float32.
  at::Tensor my_range(const std::vector<at::Tensor>& full) const;
  /// The squared global norm of `grads` (this rank's [S] range), summed over `group` (and `tp`), as [1] double.
  at::Tensor global_squares(const at::Tensor& grads, const std::vector<TrainableTensor>& tensors,
                            dist::Collectives& group, const dist::TensorParallel& tp) const;
  /// Bucket by bucket: all-gathers each rank's part of `range` ([S], any dtype) and hands the bucket's
  /// [world * B] to write(bucket start in the flat space, gathered).
  template <typename Write>
  void gather_buckets(const at::Tensor& range, dist::Collectives& group, Write write) const;
  /// [world * S]-shaped results of gather_buckets → one float32 CPU tensor per name, shaped as the layout's.
  std::map<std::string, at::Tensor> gather_named(const at::Tensor& range, dist::Collectives& group) const;

  std::vector<std::string> names_;
  std::vector<std::vector<int64_t>> shapes_;
  std::vector<int64_t> offsets_;  // where each tensor starts in the flat index space
  int64_t total_ = 0;
  int64_t part_ = 0;     // B: elements of one bucket a rank owns
  int64_t buckets_ = 0;  // the range S = buckets_ * part_
  int rank_ = 0, world_ = 1;
  at::TensorOptions float_options_;  // float32 on the model's device
  at::Tensor pending_;               // [S] float32
  at::Tensor exp_avg_, exp_avg_sq_;  // [S] float32; undefined until the first step (or a restore)
  bool keeps_master_ = false;        // some layout tensor is stored below float32
  at::Tensor master_;                // [S] float32 when keeps_master_; undefined until the first step (or a restore)
  int64_t step_ = 0;
};

}  // namespace skyrl_tx::optim
