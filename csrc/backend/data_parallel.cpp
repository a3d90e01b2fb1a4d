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
  // A custom loss's per-datum [loss, metrics...] travel too (float64: they are sums the client compares).
  auto custom_count = [](const batching::TrainRow& row) {
    return row.custom ? int64_t(1 + row.custom->metric_names().size()) : int64_t(0);
  };
  int64_t total = 0, custom_total = 0;
  for (const auto& row : rows) total += 2 * row.length(), custom_total += custom_count(row);
  at::Tensor flat = at::zeros({total}, at::TensorOptions().dtype(at::kFloat));  // [Σ 2·N_row] logprobs, losses
  at::Tensor custom = at::zeros({custom_total}, at::TensorOptions().dtype(at::kDouble));  // [Σ custom values]
  int64_t offset = 0, custom_offset = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    const int64_t n = rows[i].length(), c = custom_count(rows[i]);
    if (mine[i]) {
      const batching::DatumOutput& out = results[rows[i].request].loss_fn_outputs[rows[i].datum];
      flat.narrow(0, offset, n).copy_(out.logprobs);
      flat.narrow(0, offset + n, n).copy_(out.elementwise_loss);
      for (int64_t k = 0; k < c; ++k) custom[custom_offset + k] = out.custom_values.at(size_t(k));
    }
    offset += 2 * n, custom_offset += c;
  }
  at::Tensor shared = flat.to(device);
  group.all_reduce_sum(shared);
  flat = shared.to(at::kCPU);
  if (custom_total > 0) {
    at::Tensor shared_custom = custom.to(device);
    group.all_reduce_sum(shared_custom);
    custom = shared_custom.to(at::kCPU);
  }
  offset = 0, custom_offset = 0;
  for (auto& result : results) result.metrics["loss:sum"] = 0.0;
  for (const auto& row : rows) {
    const int64_t n = row.length(), c = custom_count(row);
    at::Tensor loss = flat.narrow(0, offset + n, n).clone();  // [N]
    std::vector<double> values;
    for (int64_t k = 0; k < c; ++k) values.push_back(custom[custom_offset + k].item<double>());
    results[row.request].loss_fn_outputs[row.datum] = {flat.narrow(0, offset, n).clone(), loss, std::move(values)};
    results[row.request].metrics["loss:sum"] += loss.to(at::kDouble).sum().item<double>();
    offset += 2 * n, custom_offset += c;
  }
}

}  // namespace skyrl_tx::backend
