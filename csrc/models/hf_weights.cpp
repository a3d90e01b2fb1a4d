// WeightStore: hands Hugging Face-named tensors to modules, collecting missing/unexpected/mis-shaped keys.
#include "models/hf_weights.h"

#include <algorithm>

#include "common/dtype.h"
#include "common/errors.h"

namespace skyrl_tx::models {
namespace {

std::string join_first(std::vector<std::string> keys, size_t limit = 8) {
  std::sort(keys.begin(), keys.end());
  std::string out;
  for (size_t i = 0; i < keys.size() && i < limit; ++i) out += (i ? ", " : "") + keys[i];
  if (keys.size() > limit) out += str_cat(", ... (", keys.size() - limit, " more)");
  return out;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

at::Tensor WeightStore::take_owned(const std::string& name, at::IntArrayRef shape, int owner,
                                   const dist::TensorParallel& tp) {
  if (!tp.enabled()) return take(name, shape);
  splits_[name] = {-1, owner, std::vector<int64_t>(shape.begin(), shape.end())};
  if (tp.rank() == owner) return take(name, shape);
  if (holds_parts_) return take(name, {0, 0});
  take(name, shape);  // checked and dropped: another rank holds it
  return at::empty({0, 0}, at::TensorOptions().dtype(dtype_).device(device_));
}

WeightStore::WeightStore(WeightMap weights, at::ScalarType dtype, at::Device device, bool holds_parts, bool adopt)
    : weights_(std::move(weights)), dtype_(dtype), device_(device), holds_parts_(holds_parts), adopt_(adopt) {}

at::Tensor WeightStore::take_part(const std::string& name, at::IntArrayRef shape, int64_t dim,
                                  const dist::TensorParallel& tp) {
  if (!tp.enabled()) return take(name, shape);
  splits_[name] = {dim, -1, std::vector<int64_t>(shape.begin(), shape.end())};
  const dist::Shard shard = tp.shard(shape[dim]);
  std::vector<int64_t> part_shape(shape.begin(), shape.end());
  part_shape[dim] = shard.length;
  if (holds_parts_) return take(name, part_shape);
  auto it = weights_.find(name);
  if (it == weights_.end() || it->second.sizes() != shape) {  // recorded as missing or mis-shaped
    return take(name, shape).narrow(dim, shard.begin, shard.length);
  }
  at::Tensor whole = std::move(it->second);
  weights_.erase(it);
  // A copy of the part only: the whole tensor (a view of the file's memory map: only the part's pages are read when
  // the split is by rows) is never moved to the device.
  return whole.narrow(dim, shard.begin, shard.length).to(device_, dtype_, /*non_blocking=*/false, /*copy=*/true)
      .contiguous();
}

at::Tensor WeightStore::take_sections(const std::string& name, at::IntArrayRef shape, int64_t dim,
                                      const std::vector<int64_t>& sections, const dist::TensorParallel& tp) {
  if (!tp.enabled()) return take(name, shape);
  splits_[name] = {dim, -1, std::vector<int64_t>(shape.begin(), shape.end()), sections};
  std::vector<int64_t> part_shape(shape.begin(), shape.end());
  part_shape[dim] = 0;
  for (int64_t n : sections) part_shape[dim] += tp.shard(n).length;
  if (holds_parts_) return take(name, part_shape);
  auto it = weights_.find(name);
  if (it == weights_.end() || it->second.sizes() != shape) {  // recorded as missing or mis-shaped
    return tp.narrow_sections(take(name, shape), dim, sections);
  }
  at::Tensor whole = std::move(it->second);
  weights_.erase(it);
  // As take_part: the parts are cut on the host; only they are copied to the device.
  return tp.narrow_sections(whole, dim, sections).to(device_, dtype_, /*non_blocking=*/false, /*copy=*/true);
}

at::Tensor WeightStore::take_optional(const std::string& name, at::IntArrayRef shape) {
  auto it = weights_.find(name);
  if (it == weights_.end()) return at::Tensor();
  at::Tensor t = std::move(it->second);
  weights_.erase(it);
  if (t.sizes() != shape) {
    mismatched_.push_back(str_cat(name, " (got ", shape_str(t), ", expected ", shape, ")"));
    return at::zeros(shape, at::TensorOptions().dtype(dtype_).device(device_));
  }
  if (adopt_ && t.device() == device_ && t.scalar_type() == dtype_ && t.is_contiguous()) return t;
  // Else a copy: `t` may be a view of the checkpoint file's memory map (models/safetensors_mmap.py), which the
  // model must not keep (a file replaced under a running server would take its weights with it).
  return t.to(device_, dtype_, /*non_blocking=*/false, /*copy=*/true).contiguous();
}

at::Tensor WeightStore::take(const std::string& name, at::IntArrayRef shape) {
  at::Tensor t = take_optional(name, shape);
  if (t.defined()) return t;
  missing_.push_back(name);
  return at::zeros(shape, at::TensorOptions().dtype(dtype_).device(device_));
}

void WeightStore::finish() const {
  std::vector<std::string> unexpected;
  for (const auto& [name, tensor] : weights_) {
    if (!ends_with(name, "rotary_emb.inv_freq")) unexpected.push_back(name);
  }
  if (missing_.empty() && mismatched_.empty() && unexpected.empty()) return;
  std::string message = "load weights: checkpoint does not match the model config";
  if (!missing_.empty()) message += "; missing keys: " + join_first(missing_);
  if (!mismatched_.empty()) message += "; shape mismatch: " + join_first(mismatched_);
  if (!unexpected.empty()) message += "; unexpected keys: " + join_first(unexpected);
  throw InvalidArgument(message + "; check that config.json belongs to these safetensors files");
}

}  // namespace skyrl_tx::models
