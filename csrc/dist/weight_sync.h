// WeightSync: a versioned set of named tensors from one rank to every other rank of a c10d group, in buckets.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "dist/collectives.h"

namespace skyrl_tx::dist {

/// What the last sync moved.
struct WeightSyncStats {
  int64_t version = -1;
  int64_t tensors = 0;
  int64_t bytes = 0;    // tensor payload (the manifest not counted)
  int64_t buckets = 0;  // broadcasts of payload
  double seconds = 0.0;
};

/// How trainer weights reach sampler processes without the disk: the root (the trainer) broadcasts a manifest
/// (version, then every tensor's name, dtype and shape), then the payload in buckets of at most `bucket_bytes`
/// (consecutive tensors of one dtype packed end to end; a larger tensor is its own bucket). The root packs bucket
/// k + 1 while bucket k is on the wire. Receivers get the root's tensors bit for bit, as views of the buckets they
/// received into (no unpacking copy). NCCL on GPUs, Gloo on CPUs: the same calls on the group's c10d backend.
class WeightSync {
 public:
  WeightSync(std::shared_ptr<Collectives> group, int root, int64_t bucket_bytes);

  /// Collective: every rank of the group calls it once per sync. The root passes the tensors (any devices and
  /// dtypes; on a GPU group, CUDA tensors) and gets them back; every other rank passes an empty map and gets the
  /// root's tensors (names, dtypes, shapes, values) on `device`. `version` is the root's; receivers return it in
  /// last().version.
  std::map<std::string, at::Tensor> sync(int64_t version, const std::map<std::string, at::Tensor>& tensors,
                                         c10::Device device);
  const WeightSyncStats& last() const { return last_; }
  bool is_root() const { return group_->rank() == root_; }

 private:
  std::shared_ptr<Collectives> group_;
  int root_;
  int64_t bucket_bytes_;
  WeightSyncStats last_;
};

}  // namespace skyrl_tx::dist
