// TensorParallel: a tensor-parallel group's rank and size, the contiguous shard of a dimension each rank holds, and
// the differentiable collectives at the edges of sharded layers (Megatron-LM's f and g; Shoeybi et al. 2019, §3).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "dist/collectives.h"

namespace skyrl_tx::dist {

/// Rows [begin, begin + length) of a dimension: what one rank holds of it.
struct Shard {
  int64_t begin = 0;
  int64_t length = 0;
};

/// How a LoRA-capable linear layer is split over the tensor-parallel ranks (replicated when the size is 1).
enum class TpSplit {
  kReplicated,  // every rank holds all of it
  kColumn,      // output features sharded (W [out/tp, in], B [out/tp, r]); A replicated, its gradient partial
  kRow,         // input features sharded (W [out, in/tp], A [r, in/tp]); B replicated, its gradient partial
  kOwned,       // expert parallelism: one rank holds the whole layer (an expert), the others an empty one
  kPartial,     // every rank holds all of it, but only its heads use the output (MLA's q_a / kv_a projections):
                // both factors' gradients are partial
};

/// How one tensor is held across a tensor-parallel group, and its shape in one process.
struct TensorSplit {
  int64_t dim = -1;  // >= 0: each rank holds its shard of this dimension
  int owner = -1;    // >= 0: this rank holds it whole, the others an empty tensor (an expert's)
  std::vector<int64_t> whole_shape;  // set unless replicated
  // With `dim`: whole sizes of consecutive sections along it, each split over the ranks on its own (Gated
  // DeltaNet's fused [q | k | v] projection: a rank holds its heads of each); empty: the dimension is one section.
  std::vector<int64_t> sections = {};
  bool replicated() const { return dim < 0 && owner < 0; }
};

class TensorParallel {
 public:
  /// No group (or a group of one): every call is the identity of one process.
  TensorParallel() = default;
  explicit TensorParallel(std::shared_ptr<Collectives> group) : group_(std::move(group)) {}

  int rank() const { return group_ ? group_->rank() : 0; }
  int size() const { return group_ ? group_->world_size() : 1; }
  bool enabled() const { return size() > 1; }
  Collectives& group() const;

  /// The part of [0, n) rank `rank` holds: ceil(n / size) each in rank order, the last ranks fewer (maybe none).
  Shard shard_of(int64_t n, int rank) const;
  Shard shard(int64_t n) const { return shard_of(n, rank()); }
  /// This rank's shard of `full` along `dim` (a contiguous copy, so the full tensor can be freed).
  at::Tensor narrow(const at::Tensor& full, int64_t dim) const;

  /// f: the identity forward; the backward sums the gradient over the group. Wraps the input of column-parallel
  /// layers, so whatever computed it (a norm, the residual stream) gets the gradient of every rank's shard.
  at::Tensor copy_in(const at::Tensor& x) const;
  /// g: the forward sums over the group; the backward is the identity. Ends a row-parallel layer (each rank's
  /// product of its input columns is a partial sum) and the vocabulary-parallel embedding.
  at::Tensor reduce_out(const at::Tensor& x) const;
  /// No gradient: the element-wise maximum over the group.
  at::Tensor max(const at::Tensor& x) const;
  /// No gradient: `local`, this rank's shard(n) of dimension `dim`, gathered into the full tensor on every rank.
  at::Tensor gather(const at::Tensor& local, int64_t dim, int64_t n) const;
  /// No gradient: the whole tensor one process holds, on every rank (gathered, or sent by its owner); `local` as is
  /// when replicated. Every rank calls it for the same tensors in the same order.
  at::Tensor whole(const at::Tensor& local, const TensorSplit& split) const;
  /// This rank's part of `whole` (shaped like one process's tensor); `local_shape`: an owned tensor's empty shape
  /// on the other ranks.
  at::Tensor part(const at::Tensor& whole, const TensorSplit& split, at::IntArrayRef local_shape) const;
  /// Sections along `dim` (whole sizes, summing to full.size(dim)): this rank's shard of each, concatenated.
  at::Tensor narrow_sections(const at::Tensor& full, int64_t dim, const std::vector<int64_t>& sections) const;

 private:
  std::shared_ptr<Collectives> group_;
};

/// The group of one: what layers built without tensor parallelism (tests, experts) refer to.
inline const TensorParallel kNoTensorParallel{};

}  // namespace skyrl_tx::dist
