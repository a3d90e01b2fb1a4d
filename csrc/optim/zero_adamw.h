// ZeroAdamState: AdamW for a data-parallel full fine-tune with ZeRO-2 sharding (gradients and moments sharded).
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "dist/collectives.h"
#include "optim/adamw.h"

namespace skyrl_tx::optim {

/// The model's stepped tensors are laid end to end in one index space of `total` elements, padded to
/// world_size * S; rank r owns elements [r * S, (r + 1) * S). A rank keeps, for its range only: the gradients
/// summed over the ranks (reduce-scattered after every batch, accumulated until optim_step) and the two AdamW
/// moments; it updates its range, then every rank all-gathers the updated weights, so every rank still holds the
/// whole model for its forward passes. Per rank: the weights plus (gradients + 2 moments) / world_size in float32,
/// instead of the weights plus 3 full float32 copies. Same arithmetic as AdamState, element for element (the
/// global grad norm is summed in another order: equal to ~1e-7 relative).
/// Every rank calls every collective method in the same order with the same tensors (names and shapes).
class ZeroAdamState {
 public:
  /// The layout of `tensors` (one model's stepped tensors, the same on every rank) over `group`'s ranks.
  ZeroAdamState(const std::vector<TrainableTensor>& tensors, const dist::Collectives& group);

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
  /// metrics. `tensors` in the layout's order.
  std::map<std::string, double> step(const std::vector<TrainableTensor>& tensors, const AdamParams& params,
                                     dist::Collectives& group);

  int64_t num_steps() const { return step_; }
  /// Full moments by tensor name, as float32 CPU tensors (empty before the first step). Collective.
  std::map<std::string, std::pair<at::Tensor, at::Tensor>> gather_moments(dist::Collectives& group) const;
  /// The pending gradients of every tensor by name, as float32 CPU tensors (zeros when none). Collective.
  std::map<std::string, at::Tensor> gather_pending(dist::Collectives& group) const;
  /// Replaces the state with full moments by name (a checkpoint; empty: none yet): keeps this rank's range.
  /// The caller has checked names and shapes.
  void restore(int64_t step, const std::map<std::string, std::pair<at::Tensor, at::Tensor>>& moments);
  /// Bytes of optimizer state this rank holds: pending gradients and moments (its range only).
  int64_t local_bytes() const;

 private:
  /// Full-length flat tensors (one per layout tensor, any dtype) → this rank's [S] range as float32.
  at::Tensor my_range(const std::vector<at::Tensor>& full) const;
  /// [world * S] gathered → one tensor per name, shaped as the layout's.
  std::map<std::string, at::Tensor> split(const at::Tensor& gathered) const;

  std::vector<std::string> names_;
  std::vector<std::vector<int64_t>> shapes_;
  std::vector<int64_t> offsets_;  // where each tensor starts in the flat index space
  int64_t total_ = 0, shard_ = 0;
  int rank_ = 0, world_ = 1;
  at::TensorOptions float_options_;  // float32 on the model's device
  at::Tensor pending_;               // [S] float32
  at::Tensor exp_avg_, exp_avg_sq_;  // [S] float32; undefined until the first step (or a restore)
  int64_t step_ = 0;
};

}  // namespace skyrl_tx::optim
