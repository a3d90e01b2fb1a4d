// WeightStore: hands Hugging Face-named tensors to modules, collecting missing/unexpected/mis-shaped keys.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <unordered_map>
#include <vector>

namespace skyrl_tx::models {

using WeightMap = std::unordered_map<std::string, at::Tensor>;

/// Modules `take` their parameters by HF name while the model is built; `finish` then throws one
/// InvalidArgument that lists every problem at once, so a bad checkpoint is diagnosed in one try.
class WeightStore {
 public:
  WeightStore(WeightMap weights, at::ScalarType dtype, at::Device device);

  /// Removes `name` and returns it cast to the compute dtype on the device. A missing or mis-shaped
  /// key is recorded and a zero placeholder of `shape` returned so construction can continue.
  at::Tensor take(const std::string& name, at::IntArrayRef shape);
  /// Like take, but a missing key is fine (returns an undefined tensor), e.g. lm_head when tied.
  at::Tensor take_optional(const std::string& name, at::IntArrayRef shape);
  /// Throws InvalidArgument listing missing, mis-shaped and unexpected keys (rotary inv_freq buffers ignored).
  void finish() const;

 private:
  WeightMap weights_;
  at::ScalarType dtype_;
  at::Device device_;
  std::vector<std::string> missing_;
  std::vector<std::string> mismatched_;
};

}  // namespace skyrl_tx::models
