// WeightStore: hands Hugging Face-named tensors to modules, collecting missing/unexpected/mis-shaped keys.
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "dist/tensor_parallel.h"

namespace skyrl_tx::models {

using WeightMap = std::unordered_map<std::string, at::Tensor>;

/// Modules `take` their parameters by HF name while the model is built; `finish` then throws one
/// InvalidArgument that lists every problem at once, so a bad checkpoint is diagnosed in one try.
class WeightStore {
 public:
  /// holds_parts: the tensors are already one tensor-parallel rank's parts (a copy of a split model), not whole.
  /// adopt: a tensor already on the device, in the dtype and contiguous is taken as is (the caller gives up its
  /// own use of it), not copied.
  WeightStore(WeightMap weights, at::ScalarType dtype, at::Device device, bool holds_parts = false,
              bool adopt = false);

  /// Removes `name` and returns it cast to the compute dtype on the device. A missing or mis-shaped
  /// key is recorded and a zero placeholder of `shape` returned so construction can continue.
  at::Tensor take(const std::string& name, at::IntArrayRef shape);
  /// Like take, but a missing key is fine (returns an undefined tensor), e.g. lm_head when tied.
  at::Tensor take_optional(const std::string& name, at::IntArrayRef shape);
  /// Tensor parallelism: this rank's part along `dim` of `name`, whose whole shape is `shape` (cut on the host,
  /// before the copy to the device), or the part itself when the store holds parts. Records the split (splits()).
  /// A group of one: take().
  at::Tensor take_part(const std::string& name, at::IntArrayRef shape, int64_t dim, const dist::TensorParallel& tp);
  /// take_part for a dimension made of consecutive sections (whole sizes), each split over the ranks on its own.
  at::Tensor take_sections(const std::string& name, at::IntArrayRef shape, int64_t dim,
                           const std::vector<int64_t>& sections, const dist::TensorParallel& tp);
  /// Expert parallelism: `name` whole on rank `owner` (recorded: splits()), an empty [0, 0] tensor elsewhere (read
  /// and dropped, so the checkpoint still matches).
  at::Tensor take_owned(const std::string& name, at::IntArrayRef shape, int owner, const dist::TensorParallel& tp);
  /// Every tensor taken in parts or owned by one rank.
  const std::map<std::string, dist::TensorSplit>& splits() const { return splits_; }
  /// Throws InvalidArgument listing missing, mis-shaped and unexpected keys (rotary inv_freq buffers ignored).
  void finish() const;

 private:
  WeightMap weights_;
  at::ScalarType dtype_;
  at::Device device_;
  bool holds_parts_;
  bool adopt_;
  std::map<std::string, dist::TensorSplit> splits_;
  std::vector<std::string> missing_;
  std::vector<std::string> mismatched_;
};

}  // namespace skyrl_tx::models
