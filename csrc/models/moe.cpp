// MoeMlp: a routed mixture of SwiGLU experts (softmax or DeepSeek sigmoid router; shared experts), LoRA on every expert.
#include "models/moe.h"

#include <limits>

#include "common/errors.h"

namespace skyrl_tx::models {

MoeMlp::MoeMlp(const ModelConfig& config, BuildContext& ctx, const std::string& prefix)
    : top_k_(config.num_experts_per_tok),
      norm_topk_prob_(config.norm_topk_prob),
      sigmoid_(config.scoring_func == "sigmoid"),
      n_group_(config.n_group),
      topk_group_(config.topk_group),
      routed_scaling_factor_(config.routed_scaling_factor),
      gate_(ctx.weights.take(prefix + ".gate.weight", {config.num_experts, config.hidden_size})) {
  if (sigmoid_) {
    score_bias_ = ctx.weights.take(prefix + ".gate.e_score_correction_bias", {config.num_experts});
  }
  experts_.reserve(config.num_experts);
  if (ctx.experts != nullptr && ctx.experts->enabled()) split_over_ = ctx.experts;
  // Expert parallelism: rank r holds the contiguous experts experts_of(E, r), ceil(E / ranks) each.
  for (int64_t e = 0; e < config.num_experts; ++e) {
    const std::string name = str_cat(prefix, ".experts.", e);
    if (split_over_ == nullptr) {
      experts_.push_back(std::make_unique<SwiGluMlp>(config.hidden_size, config.moe_intermediate_size, false, ctx,
                                                     name));
      continue;
    }
    const int owner = split_over_->owner_of(e, config.num_experts);
    experts_.push_back(SwiGluMlp::expert(config.hidden_size, config.moe_intermediate_size, ctx, name, owner));
  }
  std::vector<SwiGluMlp*> held;  // contiguous: all experts, or this rank's share
  for (int64_t e = 0; e < config.num_experts; ++e) {
    if (!experts_[e]->held()) continue;
    if (held.empty()) first_held_ = e;
    held.push_back(experts_[e].get());
  }
  if (!held.empty()) stacked_ = std::make_unique<StackedExperts>(std::move(held), ctx.grouped_expert_gemm);
  if (config.shared_expert_intermediate_size > 0) {  // Qwen3.5 MoE: sigmoid(x · gate) scales the shared output
    shared_name_ = "shared_expert";
    shared_ = std::make_unique<SwiGluMlp>(config.hidden_size, config.shared_expert_intermediate_size, false, ctx,
                                          prefix + ".shared_expert");
    shared_gate_ = ctx.weights.take(prefix + ".shared_expert_gate.weight", {1, config.hidden_size});
  } else if (config.n_shared_experts > 0) {
    shared_ = std::make_unique<SwiGluMlp>(config.hidden_size, config.n_shared_experts * config.moe_intermediate_size,
                                          false, ctx, prefix + ".shared_experts");
  }
}

std::pair<at::Tensor, at::Tensor> MoeMlp::top_k(const at::Tensor& x) const {
  if (!sigmoid_) {
    at::Tensor logits = at::linear(x, gate_);                // [N, E]
    at::Tensor probs = at::softmax(logits, -1, at::kFloat);  // [N, E] float32, as transformers does
    auto [top_w, top_i] = at::topk(probs, top_k_, -1);       // [N, k]
    if (norm_topk_prob_) top_w = top_w / top_w.sum(-1, /*keepdim=*/true);
    return {top_w.to(logits.scalar_type()), top_i};
  }
  // DeepSeek V3 (noaux_tc): logits in float32; the bias picks experts, the unbiased sigmoid scores weigh them.
  const int64_t n = x.size(0), experts = gate_.size(0);
  at::Tensor scores = at::sigmoid(at::linear(x.to(at::kFloat), gate_.to(at::kFloat)));  // [N, E]
  at::Tensor choice = (scores + score_bias_.to(at::kFloat)).detach();                   // [N, E]
  if (n_group_ > 1) {
    // A group's score is the sum of its best two experts; only the topk_group best groups stay eligible.
    at::Tensor group_scores =
        std::get<0>(choice.view({n, n_group_, experts / n_group_}).topk(2, -1)).sum(-1);  // [N, G]
    at::Tensor group_idx = std::get<1>(at::topk(group_scores, topk_group_, -1, true, /*sorted=*/false));
    at::Tensor group_mask = at::zeros_like(group_scores).scatter_(1, group_idx, 1.0);  // [N, G]
    at::Tensor score_mask =
        group_mask.unsqueeze(-1).expand({n, n_group_, experts / n_group_}).reshape({n, experts}).to(at::kBool);
    choice = choice.masked_fill(score_mask.logical_not(), -std::numeric_limits<float>::infinity());
  }
  at::Tensor top_i = std::get<1>(at::topk(choice, top_k_, -1, true, /*sorted=*/false));  // [N, k]
  at::Tensor top_w = scores.gather(1, top_i);                                              // [N, k] float32
  if (norm_topk_prob_) top_w = top_w / (top_w.sum(-1, /*keepdim=*/true) + 1e-20);
  return {top_w * routed_scaling_factor_, top_i};
}

ExpertRouting MoeMlp::route(const at::Tensor& x) const {
  const int64_t experts = num_experts();
  auto [top_w, top_i] = top_k(x);  // [N, k]
  // Stable sort keeps each expert's tokens in row order: adapter segments stay contiguous inside each expert.
  auto [sorted_expert, order] = at::sort(top_i.reshape({-1}), /*stable=*/true, /*dim=*/0, /*descending=*/false);
  ExpertRouting r;
  r.token = at::floor_divide(order, top_k_);                   // [N * k]
  r.weight = top_w.reshape({-1}).index_select(0, order);     // [N * k]
  // The one host sync of an MoE layer: the loop below needs each expert's slice length.
  at::Tensor count = at::bincount(sorted_expert, {}, experts).cpu();  // [E]
  r.count.assign(count.data_ptr<int64_t>(), count.data_ptr<int64_t>() + experts);
  return r;
}

lora::AdapterSegments expert_segments(const lora::AdapterSegments& segments, const at::Tensor& token,
                                      const int64_t* per_segment) {
  const int64_t n = token.size(0);
  if (segments.row_dense()) return lora::AdapterSegments::row_dense(segments.slot_columns().index_select(0, token));
  if (segments.only_base()) return lora::AdapterSegments::uniform(0, n);
  std::vector<lora::Segment> out;
  int64_t begin = 0;
  for (size_t s = 0; s < segments.segments().size(); ++s) {
    if (per_segment[s] == 0) continue;
    out.push_back({segments.segments()[s].slot, begin, per_segment[s]});
    begin += per_segment[s];
  }
  SKYRL_TX_INTERNAL_ASSERT(begin == n, "expert segments must cover the expert's tokens");
  return lora::AdapterSegments(std::move(out));
}

at::Tensor MoeMlp::forward(const at::Tensor& x, const lora::AdapterSegments& segments) const {
  at::Tensor out = split_over_ != nullptr && split_over_->distinct_tokens() ? routed_exchanged(x, segments)
                                                                           : routed_replicated(x, segments);
  if (shared_) {
    at::Tensor shared = shared_->forward(x, segments);  // [N, hidden]
    out = out + (shared_gate_.defined() ? at::sigmoid(at::linear(x, shared_gate_)) * shared : shared);
  }
  return out;
}

at::Tensor MoeMlp::routed_replicated(const at::Tensor& x_in, const lora::AdapterSegments& segments) const {
  const int64_t experts = num_experts();
  const dist::TensorParallel* group = split_over_ ? &split_over_->group() : nullptr;
  // Expert parallelism: the routed path's input gradient is each rank's experts' share, summed over the group (f);
  // the shared experts run whole on every rank, on the input as it is.
  const at::Tensor x = group ? group->copy_in(x_in) : x_in;
  ExpertRouting r = route(x);
  // Segmented LoRA batches: how many of each expert's tokens fall in each adapter segment ([E, S] on the host).
  const auto& segs = segments.segments();
  const bool per_segment = !segments.row_dense() && !segments.only_base();
  std::vector<int64_t> seg_counts;
  if (per_segment) {
    std::vector<int64_t> seg_of_row(x.size(0));
    for (size_t s = 0; s < segs.size(); ++s) {
      SKYRL_TX_INTERNAL_ASSERT(s == 0 || segs[s].begin >= segs[s - 1].begin, "segments must be in row order");
      std::fill_n(seg_of_row.begin() + segs[s].begin, segs[s].length, static_cast<int64_t>(s));
    }
    const int64_t num_segs = static_cast<int64_t>(segs.size());
    at::Tensor seg_of_token =
        at::tensor(seg_of_row, at::TensorOptions().dtype(at::kLong)).to(x.device()).index_select(0, r.token);
    at::Tensor expert_of_pair = at::repeat_interleave(
        at::arange(experts, r.token.options()), at::tensor(r.count, at::kLong).to(x.device()));  // [N * k]
    at::Tensor count = at::bincount(expert_of_pair * num_segs + seg_of_token, {}, experts * num_segs).cpu();
    seg_counts.assign(count.data_ptr<int64_t>(), count.data_ptr<int64_t>() + experts * num_segs);
  }
  // The held experts are contiguous, so their pairs are one slice [begin, begin + n) of the expert-sorted pairs.
  const int64_t held = stacked_ ? experts_held() : 0;
  int64_t begin = 0, n = 0;
  for (int64_t e = 0; e < first_held_; ++e) begin += r.count[e];
  std::vector<int64_t> counts(r.count.begin() + first_held_, r.count.begin() + first_held_ + held);
  std::vector<lora::AdapterSegments> expert_segs;
  for (int64_t j = 0; j < held; ++j) {
    const int64_t e = first_held_ + j;
    if (r.count[e] > 0) {
      expert_segs.push_back(expert_segments(segments, r.token.narrow(0, begin + n, r.count[e]),
                                            per_segment ? &seg_counts[e * segs.size()] : nullptr));
    }
    n += r.count[e];
  }
  // [N, hidden]. Expert parallelism: zeros that still depend on x, so the input's gradient sum (f's backward, a
  // collective) runs on a rank whose experts got no token too, as on the others.
  at::Tensor out = group ? at::where(at::zeros({}, x.options().dtype(at::kBool)), x, at::zeros({}, x.options()))
                        : at::zeros_like(x);
  if (n > 0) {
    at::Tensor token = r.token.narrow(0, begin, n);                                         // [n]
    at::Tensor done = run_experts(x.index_select(0, token), first_held_, counts, expert_segs);  // [n, hidden]
    // The sigmoid router's weights are float32 (as in transformers): the product is cast back before the scatter.
    out = out.index_add(0, token, (done * r.weight.narrow(0, begin, n).unsqueeze(1)).to(x.scalar_type()));
  }
  // Expert parallelism: each rank summed its experts' outputs; the routed sum is theirs together.
  if (group) out = group->reduce_out(out);
  return out;
}

at::Tensor MoeMlp::run_experts(const at::Tensor& rows, int64_t first, const std::vector<int64_t>& counts,
                               const std::vector<lora::AdapterSegments>& segments) const {
  if (stacked_->usable(rows)) return stacked_->forward(rows, counts, segments);
  std::vector<at::Tensor> outs;
  int64_t offset = 0;
  size_t with_rows = 0;
  for (size_t j = 0; j < counts.size(); ++j) {
    if (counts[j] == 0) continue;
    outs.push_back(experts_[first + j]->forward(rows.narrow(0, offset, counts[j]), segments[with_rows++]));
    offset += counts[j];
  }
  return at::cat(outs);  // [n, hidden]
}

int64_t MoeMlp::experts_held() const {
  int64_t held = 0;
  for (const auto& expert : experts_) held += expert->held() ? 1 : 0;
  return held;
}

void MoeMlp::collect_lora(const std::string& prefix, std::vector<NamedLoraModule>& out) {
  for (int64_t e = 0; e < num_experts(); ++e) experts_[e]->collect_lora(str_cat(prefix, ".experts.", e), out);
  if (shared_) shared_->collect_lora(prefix + "." + shared_name_, out);
}

void MoeMlp::collect_parameters(const std::string& prefix, std::vector<NamedParameter>& out) const {
  out.emplace_back(prefix + ".gate.weight", gate_);
  // NOTE: e_score_correction_bias is a buffer in transformers (DeepSeek adjusts it outside the gradient step). It is
  // listed so model copies (full fine-tuning, frozen snapshots, saved weights) carry it; its gradient is always 0
  // (it only steers the top-k choice), and optim_step skips it (models::is_buffer_name), weight decay included.
  if (score_bias_.defined()) out.emplace_back(prefix + ".gate.e_score_correction_bias", score_bias_);
  for (int64_t e = 0; e < num_experts(); ++e) experts_[e]->collect_parameters(str_cat(prefix, ".experts.", e), out);
  if (shared_) shared_->collect_parameters(prefix + "." + shared_name_, out);
  if (shared_gate_.defined()) out.emplace_back(prefix + ".shared_expert_gate.weight", shared_gate_);
}

}  // namespace skyrl_tx::models
