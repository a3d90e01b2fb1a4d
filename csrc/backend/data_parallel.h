// Data parallelism inside one forward_backward: which rows this rank computes, and sharing the rows' outputs.
#pragma once

#include <vector>

#include "batching/train_batch.h"
#include "dist/collectives.h"

namespace skyrl_tx::backend {

/// Every rank gets the same requests and computes the rows split_rows_by_tokens gives it: mine[i] says whether
/// row i is this rank's.
std::vector<char> rows_of_this_rank(const std::vector<batching::TrainRow>& rows, const dist::Collectives& group);

/// Each row's outputs were computed by exactly one rank: one sum all-reduce of every row's logprobs and losses
/// (zeros where another rank computed the row; x + 0 is exact) gives every rank all of them, in the results'
/// places, identical to one process. Then "loss:sum" per request, summed over its rows in row order.
/// `device`: where the buffer lives for the collective (CPU for Gloo, the model's CUDA device for NCCL).
void share_row_outputs(const std::vector<batching::TrainRow>& rows, const std::vector<char>& mine,
                       std::vector<batching::TrainResult>& results, dist::Collectives& group, c10::Device device);

}  // namespace skyrl_tx::backend
