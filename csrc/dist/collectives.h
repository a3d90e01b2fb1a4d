// Collectives: the c10d operations the engine's ranks run (sum all-reduce, reduce-scatter, all-gather, broadcast,
// all-to-all, barrier) on a process group joined through c10d's TCPStore — Gloo on CPU, NCCL on CUDA, behind the
// same calls — with per-operation counters, and the data-parallel split.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace skyrl_tx::dist {

/// What one kind of collective cost this rank since the last reset: how often it ran, the bytes of the buffer
/// this rank handed it (all_reduce: the buffer; reduce_scatter: the full input; all_gather: the full output;
/// broadcast: the tensor), and the seconds this rank spent inside it (waiting for slower ranks included).
struct CollectiveStats {
  int64_t calls = 0;
  int64_t bytes = 0;
  double seconds = 0.0;
};

/// Why the group is made in Python (torch.distributed: TCPStore rendezvous, torchrun's env:// variables) and used
/// here: the gloo headers ProcessGroupGloo.hpp needs are not shipped in the torch wheel, while the generic
/// c10d::ProcessGroup interface is; every collective of a step is still issued from C++, on the group torch made.
class Collectives;

/// A collective issued and not yet waited for (a broadcast overlapping the next bucket's packing).
class PendingCollective {
 public:
  /// Blocks until done; failures and counters as for the blocking calls.
  void wait();

 private:
  friend class Collectives;
  PendingCollective(Collectives* owner, c10::intrusive_ptr<c10d::Work> work, const char* what, int64_t bytes,
                    std::chrono::steady_clock::time_point started)
      : owner_(owner), work_(std::move(work)), what_(what), bytes_(bytes), started_(started) {}
  Collectives* owner_;
  c10::intrusive_ptr<c10d::Work> work_;
  const char* what_;
  int64_t bytes_;
  std::chrono::steady_clock::time_point started_;
};

class Collectives {
 public:
  explicit Collectives(c10::intrusive_ptr<c10d::ProcessGroup> group);

  int rank() const;
  int world_size() const;
  /// In place on every rank: the element-wise sum over ranks. Same shape and dtype on every rank.
  void all_reduce_sum(at::Tensor& tensor);
  /// In place on every rank: the element-wise maximum over ranks (a vocabulary-parallel softmax's shift).
  void all_reduce_max(at::Tensor& tensor);
  /// The tensors (any shapes, one dtype) summed over ranks through one flat buffer: one collective per call,
  /// however many adapter factors a step trained. Every rank passes the same list of shapes in the same order.
  void all_reduce_sum_flat(std::vector<at::Tensor>& tensors);
  /// `input` [world_size * S] (contiguous, the same shape on every rank) summed over ranks; returns this rank's
  /// slice [S] of the sum (elements [rank * S, (rank + 1) * S)). Half the bytes of an all-reduce.
  at::Tensor reduce_scatter_sum(const at::Tensor& input);
  /// `shard` [S] from every rank, concatenated in rank order: [world_size * S].
  at::Tensor all_gather(const at::Tensor& shard);
  /// In place: every rank ends with `root`'s values.
  void broadcast(at::Tensor& tensor, int root);
  /// broadcast, issued: the tensor must stay alive and untouched until wait(). Collectives complete in the order
  /// they were issued.
  PendingCollective broadcast_async(at::Tensor& tensor, int root);
  void barrier();
  /// Rows of `input` [sum(send), ...] go to the ranks in rank order, send[r] of them to rank r; returns the rows
  /// every rank sent this one, in rank order: [sum(recv), ...] (recv[r] from rank r). Every rank's send[r'] to a
  /// rank r' equals that rank's recv[this rank]. Expert parallelism's token dispatch.
  at::Tensor all_to_all(const at::Tensor& input, const std::vector<int64_t>& send, const std::vector<int64_t>& recv);

  /// Counters per operation name ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "barrier",
  /// "all_to_all").
  std::map<std::string, CollectiveStats> stats() const;
  void reset_stats();

 private:
  friend class PendingCollective;
  void all_reduce(at::Tensor& tensor, c10d::ReduceOp::RedOpType op, const char* what);
  /// Waits for `work`; a failed or timed-out collective (a dead or hung rank) becomes skyrl_tx::Internal naming
  /// the operation and this rank, so the engine tears the group down and recovers as after a crash. Counts the
  /// call, `bytes` and the time from `started` (before the work was issued) under `what`.
  void wait(const c10::intrusive_ptr<c10d::Work>& work, const char* what, int64_t bytes,
            std::chrono::steady_clock::time_point started);

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  mutable std::mutex stats_mutex_;  // the engine thread counts; a metrics reader may read
  std::map<std::string, CollectiveStats> stats_;
};

/// Data parallelism splits a batch by tokens, not rows: rows (their token counts) are taken longest first and each
/// goes to the rank with the fewest tokens so far (lowest rank on ties; LPT scheduling, within 4/3 of the best
/// split). Returns the rank of each row, in row order. Any row count works, zero rows on a rank included.
std::vector<int64_t> split_rows_by_tokens(const std::vector<int64_t>& row_tokens, int64_t world_size);

}  // namespace skyrl_tx::dist
