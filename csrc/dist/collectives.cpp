// Collectives over a c10d process group (see collectives.h) and the token-balanced data-parallel split.
#include "dist/collectives.h"

#include <algorithm>
#include <numeric>

#include "common/errors.h"

namespace skyrl_tx::dist {

Collectives::Collectives(c10::intrusive_ptr<c10d::ProcessGroup> group) : group_(std::move(group)) {
  SKYRL_TX_CHECK(group_, InvalidArgument, "Collectives: no process group");
}

int Collectives::rank() const { return group_->getRank(); }
int Collectives::world_size() const { return group_->getSize(); }

void Collectives::wait(const c10::intrusive_ptr<c10d::Work>& work, const char* what, int64_t bytes,
                       std::chrono::steady_clock::time_point started) {
  try {
    work->wait();
  } catch (const std::exception& e) {
    throw Internal(str_cat("collective ", what, " failed on rank ", rank(), " of ", world_size(),
                           " (a rank died or hung past the group timeout): ", e.what()),
                   __FILE__, __LINE__);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  std::lock_guard<std::mutex> lock(stats_mutex_);
  CollectiveStats& s = stats_[what];
  s.calls += 1, s.bytes += bytes, s.seconds += seconds;
}

std::map<std::string, CollectiveStats> Collectives::stats() const {
  std::lock_guard<std::mutex> lock(stats_mutex_);
  return stats_;
}

void Collectives::reset_stats() {
  std::lock_guard<std::mutex> lock(stats_mutex_);
  stats_.clear();
}

void Collectives::all_reduce(at::Tensor& tensor, c10d::ReduceOp::RedOpType op, const char* what) {
  SKYRL_TX_CHECK(tensor.is_contiguous(), InvalidArgument, what, ": the tensor must be contiguous");
  const auto started = std::chrono::steady_clock::now();
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions options;
  options.reduceOp = op;
  wait(group_->allreduce(tensors, options), what, tensor.nbytes(), started);
}

void Collectives::all_reduce_sum(at::Tensor& tensor) { all_reduce(tensor, c10d::ReduceOp::SUM, "all_reduce"); }

void Collectives::all_reduce_max(at::Tensor& tensor) { all_reduce(tensor, c10d::ReduceOp::MAX, "all_reduce_max"); }

at::Tensor Collectives::reduce_scatter_sum(const at::Tensor& input) {
  SKYRL_TX_CHECK(input.is_contiguous() && input.dim() == 1 && input.numel() % world_size() == 0, InvalidArgument,
                 "reduce_scatter_sum: the input must be a contiguous 1-d tensor whose length divides by the world "
                 "size ", world_size(), " (got shape ", input.sizes(), ")");
  const auto started = std::chrono::steady_clock::now();
  at::Tensor output = at::empty({input.numel() / world_size()}, input.options());  // [S]
  at::Tensor in = input;
  c10d::ReduceScatterOptions options;
  options.reduceOp = c10d::ReduceOp::SUM;
  wait(group_->_reduce_scatter_base(output, in, options), "reduce_scatter", input.nbytes(), started);
  return output;
}

at::Tensor Collectives::all_gather(const at::Tensor& shard) {
  SKYRL_TX_CHECK(shard.is_contiguous() && shard.dim() == 1, InvalidArgument,
                 "all_gather: the shard must be a contiguous 1-d tensor (got shape ", shard.sizes(), ")");
  const auto started = std::chrono::steady_clock::now();
  at::Tensor output = at::empty({shard.numel() * world_size()}, shard.options());  // [W * S]
  at::Tensor in = shard;
  wait(group_->_allgather_base(output, in), "all_gather", output.nbytes(), started);
  return output;
}

void Collectives::all_reduce_sum_flat(std::vector<at::Tensor>& tensors) {
  if (tensors.empty()) return;
  std::vector<at::Tensor> flat_parts;
  flat_parts.reserve(tensors.size());
  for (const auto& t : tensors) flat_parts.push_back(t.reshape({-1}));
  at::Tensor flat = at::cat(flat_parts);  // [sum of numels], one buffer for one collective
  all_reduce_sum(flat);
  int64_t offset = 0;
  for (auto& t : tensors) {
    t.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
    offset += t.numel();
  }
}

void Collectives::broadcast(at::Tensor& tensor, int root) { broadcast_async(tensor, root).wait(); }

PendingCollective Collectives::broadcast_async(at::Tensor& tensor, int root) {
  SKYRL_TX_CHECK(root >= 0 && root < world_size(), InvalidArgument, "broadcast: root ", root, " is not a rank of ",
                 world_size());
  SKYRL_TX_CHECK(tensor.is_contiguous(), InvalidArgument, "broadcast: the tensor must be contiguous");
  const auto started = std::chrono::steady_clock::now();
  std::vector<at::Tensor> tensors{tensor};
  c10d::BroadcastOptions options;
  options.rootRank = root;
  return PendingCollective(this, group_->broadcast(tensors, options), "broadcast", tensor.nbytes(), started);
}

void PendingCollective::wait() { owner_->wait(work_, what_, bytes_, started_); }

at::Tensor Collectives::all_to_all(const at::Tensor& input, const std::vector<int64_t>& send,
                                   const std::vector<int64_t>& recv) {
  const int64_t n = world_size();
  SKYRL_TX_CHECK(int64_t(send.size()) == n && int64_t(recv.size()) == n && input.dim() >= 1, InvalidArgument,
                 "all_to_all: one send and one receive count per rank (", n, "), rows along dim 0");
  int64_t sent = 0, received = 0;
  for (int64_t r = 0; r < n; ++r) sent += send[r], received += recv[r];
  SKYRL_TX_CHECK(sent == input.size(0), InvalidArgument, "all_to_all: the send counts add up to ", sent,
                 " rows, the input has ", input.size(0));
  std::vector<int64_t> shape = input.sizes().vec();
  shape[0] = received;
  at::Tensor output = at::empty(shape, input.options());  // [sum(recv), ...]
  at::Tensor in = input.contiguous();
  // c10d counts the split sizes in rows of dim 0.
  std::vector<int64_t> out_splits(recv), in_splits(send);
  const auto started = std::chrono::steady_clock::now();
  c10d::AllToAllOptions options;
  wait(group_->alltoall_base(output, in, out_splits, in_splits, options), "all_to_all", in.nbytes(), started);
  return output;
}

void Collectives::barrier() { wait(group_->barrier(), "barrier", 0, std::chrono::steady_clock::now()); }

std::vector<int64_t> split_rows_by_tokens(const std::vector<int64_t>& row_tokens, int64_t world_size) {
  SKYRL_TX_CHECK(world_size >= 1, InvalidArgument, "split_rows_by_tokens: world_size must be >= 1, got ",
                 world_size);
  std::vector<int64_t> order(row_tokens.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return row_tokens[a] > row_tokens[b]; });
  std::vector<int64_t> load(world_size, 0), rank_of_row(row_tokens.size(), 0);
  for (int64_t row : order) {
    SKYRL_TX_CHECK(row_tokens[row] >= 0, InvalidArgument, "split_rows_by_tokens: row ", row,
                   " has a negative token count");
    const int64_t rank = std::min_element(load.begin(), load.end()) - load.begin();  // first minimum: lowest rank
    rank_of_row[row] = rank;
    load[rank] += row_tokens[row];
  }
  return rank_of_row;
}

}  // namespace skyrl_tx::dist
