// MoeMlp's routed experts when the expert-parallel ranks hold different tokens: all-to-all dispatch and combine.
#include <c10/core/GradMode.h>

#include <numeric>

#include "common/errors.h"
#include "models/moe.h"

namespace skyrl_tx::models {
namespace {

// Each token's adapter slot, on the host ([N]): the training batch's segments (row-dense segments are a sampling
// batch's, which every replica holds alike and never reaches here).
std::vector<int64_t> slot_of_tokens(const lora::AdapterSegments& segments, int64_t n) {
  SKYRL_TX_INTERNAL_ASSERT(!segments.row_dense(), "an expert exchange needs segmented adapters");
  std::vector<int64_t> slot(n, 0);
  for (const lora::Segment& s : segments.segments()) std::fill_n(slot.begin() + s.begin, s.length, s.slot);
  return slot;
}

}  // namespace

at::Tensor MoeMlp::routed_exchanged(const at::Tensor& x_in, const lora::AdapterSegments& segments) const {
  const dist::ExpertParallel& ep = *split_over_;
  const int64_t experts = num_experts(), ranks = ep.size();
  const int64_t per_rank = ep.experts_of(experts, 0).length;
  const dist::Shard mine = ep.experts_of(experts, ep.rank());
  // Every rank's exchanges must be in its autograd graph, or the ranks would run different numbers of collectives
  // in backward: a rank whose input needs no gradient (a frozen prefix, a padding micro-batch) gets a zero leaf.
  at::Tensor x = x_in;
  if (at::GradMode::is_enabled() && !x.requires_grad()) {
    x = x + at::zeros({}, x.options()).requires_grad_(true);
  }
  ExpertRouting r = route(x);  // pairs grouped by expert, so by the expert's rank too

  // How many pairs go to each expert (padded to per_rank per rank), and to each rank.
  std::vector<int64_t> to_expert(ranks * per_rank, 0), send(ranks, 0);
  for (int64_t e = 0; e < experts; ++e) {
    to_expert[e] = r.count[e];
    send[ep.owner_of(e, experts)] += r.count[e];
  }
  const std::vector<int64_t> from = ep.exchange_counts(to_expert, x.device());  // [ranks * per_rank]
  std::vector<int64_t> recv(ranks, 0);
  for (int64_t s = 0; s < ranks; ++s) {
    for (int64_t j = 0; j < per_rank; ++j) recv[s] += from[s * per_rank + j];
  }

  // Each pair's adapter slot travels with it, so the expert's rank applies the right LoRA.
  const at::Tensor pair_slot = at::tensor(slot_of_tokens(segments, x.size(0)), at::TensorOptions().dtype(at::kLong))
                                   .to(x.device())
                                   .index_select(0, r.token);  // [P]
  at::Tensor xs = x.index_select(0, r.token);          // [P, hidden]
  at::Tensor received = ep.exchange(xs, send, recv);  // [R, hidden], by source rank, then expert
  at::Tensor received_slot = ep.exchange(pair_slot, send, recv).cpu();  // [R] (integers: no gradient)

  // Group the received rows by (local expert, slot): each expert's rows contiguous, each adapter's within them.
  const int64_t num_received = received.size(0);
  std::vector<int64_t> local_expert;
  local_expert.reserve(num_received);
  for (int64_t s = 0; s < ranks; ++s) {
    for (int64_t j = 0; j < per_rank; ++j) local_expert.insert(local_expert.end(), from[s * per_rank + j], j);
  }
  const int64_t* slot = received_slot.data_ptr<int64_t>();
  std::vector<int64_t> order(num_received);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return local_expert[a] != local_expert[b] ? local_expert[a] < local_expert[b] : slot[a] < slot[b];
  });
  at::Tensor order_t = at::tensor(order, at::TensorOptions().dtype(at::kLong)).to(x.device());  // [R]
  at::Tensor grouped = received.index_select(0, order_t);  // [R, hidden]

  std::vector<int64_t> counts(mine.length, 0);  // received rows per held expert
  std::vector<lora::AdapterSegments> expert_segs;
  int64_t begin = 0;
  for (int64_t j = 0; j < mine.length; ++j) {
    for (int64_t s = 0; s < ranks; ++s) counts[j] += from[s * per_rank + j];
    if (counts[j] == 0) continue;
    std::vector<lora::Segment> runs;  // runs of one slot within this expert's rows
    for (int64_t i = begin; i < begin + counts[j]; ++i) {
      const int64_t row_slot = slot[order[i]];
      if (runs.empty() || runs.back().slot != row_slot) runs.push_back({row_slot, i - begin, 0});
      runs.back().length += 1;
    }
    expert_segs.emplace_back(std::move(runs));
    begin += counts[j];
  }
  // Back in the received order ([R, hidden]); still a function of `received` when this rank ran nothing, so its
  // return exchange is in the graph as on the others.
  at::Tensor done = begin == 0 ? received * 0 : run_experts(grouped, mine.begin, counts, expert_segs);
  at::Tensor results = at::empty_like(done).index_copy(0, order_t, done);
  at::Tensor returned = ep.exchange(results, recv, send);  // [P, hidden], in xs' order
  // The router's weights (float32 for the sigmoid router, as in transformers) scale each pair before the scatter.
  return at::zeros_like(x).index_add(0, r.token, (returned * r.weight.unsqueeze(1)).to(x.scalar_type()));
}

}  // namespace skyrl_tx::models
