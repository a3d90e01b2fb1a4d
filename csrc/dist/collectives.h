// Collectives: the c10d operations the engine's ranks run (sum all-reduce, broadcast, barrier) on a process group
// joined through c10d's TCPStore — Gloo on CPU, NCCL on CUDA, behind the same calls — and the data-parallel split.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstdint>
#include <vector>

namespace skyrl_tx::dist {

/// Why the group is made in Python (torch.distributed: TCPStore rendezvous, torchrun's env:// variables) and used
/// here: the gloo headers ProcessGroupGloo.hpp needs are not shipped in the torch wheel, while the generic
/// c10d::ProcessGroup interface is; every collective of a step is still issued from C++, on the group torch made.
class Collectives {
 public:
  explicit Collectives(c10::intrusive_ptr<c10d::ProcessGroup> group);

  int rank() const;
  int world_size() const;
  /// In place on every rank: the element-wise sum over ranks. Same shape and dtype on every rank.
  void all_reduce_sum(at::Tensor& tensor);
  /// The tensors (any shapes, one dtype) summed over ranks through one flat buffer: one collective per call,
  /// however many adapter factors a step trained. Every rank passes the same list of shapes in the same order.
  void all_reduce_sum_flat(std::vector<at::Tensor>& tensors);
  /// In place: every rank ends with `root`'s values.
  void broadcast(at::Tensor& tensor, int root);
  void barrier();

 private:
  /// Waits for `work`; a failed or timed-out collective (a dead or hung rank) becomes skyrl_tx::Internal naming
  /// the operation and this rank, so the engine tears the group down and recovers as after a crash.
  void wait(const c10::intrusive_ptr<c10d::Work>& work, const char* what) const;

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
};

/// Data parallelism splits a batch by tokens, not rows: rows (their token counts) are taken longest first and each
/// goes to the rank with the fewest tokens so far (lowest rank on ties; LPT scheduling, within 4/3 of the best
/// split). Returns the rank of each row, in row order. Any row count works, zero rows on a rank included.
std::vector<int64_t> split_rows_by_tokens(const std::vector<int64_t>& row_tokens, int64_t world_size);

}  // namespace skyrl_tx::dist
