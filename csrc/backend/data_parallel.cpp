// Data-parallel rows and outputs of one forward_backward (see data_parallel.h).
#include "backend/data_parallel.h"

namespace skyrl_tx::backend {

std::vector<char> rows_of_this_rank(const std::vector<batching::TrainRow>& rows, const dist::Collectives& group) {
  std::vector<int64_t> tokens(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) tokens[i] = rows[i].length();
  const std::vector<int64_t> rank_of_row = dist::split_rows_by_tokens(tokens, group.world_size());
  std::vector<char> mine(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) mine[i] = rank_of_row[i] == group.rank();
  return mine;
}

void share_row_outputs(const std::vector<batching::TrainRow>& rows, const std::vector<char>& mine,
                       std::vector<batching::TrainResult>& results, dist::Collectives& group, c10::Device device) {
  int64_t total = 0;
  for (const auto& row : rows) total += 2 * row.length();
  at::Tensor flat = at::zeros({total}, at::TensorOptions().dtype(at::kFloat));  // [Σ 2·N_row] logprobs, losses
  int64_t offset = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    const int64_t n = rows[i].length();
    if (mine[i]) {
      const batching::DatumOutput& out = results[rows[i].request].loss_fn_outputs[rows[i].datum];
      flat.narrow(0, offset, n).copy_(out.logprobs);
      flat.narrow(0, offset + n, n).copy_(out.elementwise_loss);
    }
    offset += 2 * n;
  }
  at::Tensor shared = flat.to(device);
  group.all_reduce_sum(shared);
  flat = shared.to(at::kCPU);
  offset = 0;
  for (auto& result : results) result.metrics["loss:sum"] = 0.0;
  for (const auto& row : rows) {
    const int64_t n = row.length();
    at::Tensor loss = flat.narrow(0, offset + n, n).clone();  // [N]
    results[row.request].loss_fn_outputs[row.datum] = {flat.narrow(0, offset, n).clone(), loss};
    results[row.request].metrics["loss:sum"] += loss.to(at::kDouble).sum().item<double>();
    offset += 2 * n;
  }
}

}  // namespace skyrl_tx::backend
