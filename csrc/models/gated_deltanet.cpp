// GatedDeltaNet: Qwen3.5's linear-attention token mixer (causal conv1d, gated delta rule, gated RMSNorm) and its
// chunked (prefill, training) and recurrent (decode) forms.
#include "models/gated_deltanet.h"

#include <cmath>
#include <functional>
#include <limits>

#include "common/errors.h"
#include "models/packed_attention.h"
#include "ops/chunk_gated_delta_rule_cpu.h"
#include "ops/conv_silu_cpu.h"
#include "ops/conv_step_cpu.h"
#include "ops/gated_delta_step_cpu.h"
#include "ops/rmsnorm_cpu.h"
#include "ops/swiglu.h"

namespace skyrl_tx::models {
namespace {

// FLA's l2norm as transformers writes it: x * rsqrt(sum(x^2) + eps), eps 1e-6.
at::Tensor l2norm(const at::Tensor& x) { return x * at::rsqrt((x * x).sum(-1, /*keepdim=*/true) + 1e-6); }

// [B, T, H, D] (or [B, T, H]) → [B, H, T, D] (or [B, H, T]) float32 contiguous, q/k heads repeated to Hv.
at::Tensor heads_first(const at::Tensor& x, int64_t repeat = 1) {
  at::Tensor r = repeat > 1 ? x.repeat_interleave(repeat, 2) : x;
  return r.transpose(1, 2).to(at::kFloat).contiguous();
}

}  // namespace

std::pair<at::Tensor, at::Tensor> chunk_gated_delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                         const at::Tensor& g, const at::Tensor& beta,
                                                         int64_t chunk_size, const at::Tensor& initial_state) {
  if (ops::chunk_gated_delta_rule_cpu_applies(q, k, v, g, beta)) {
    return ops::chunk_gated_delta_rule_cpu(q, k, v, g, beta, chunk_size, initial_state);
  }
  return chunk_gated_delta_rule_formula(q, k, v, g, beta, chunk_size, initial_state);
}

std::pair<at::Tensor, at::Tensor> chunk_gated_delta_rule_formula(const at::Tensor& q_in, const at::Tensor& k_in,
                                                                 const at::Tensor& v_in, const at::Tensor& g_in,
                                                                 const at::Tensor& beta_in, int64_t chunk_size,
                                                                 const at::Tensor& initial_state) {
  const at::ScalarType dtype = q_in.scalar_type();
  const int64_t batch = k_in.size(0), seq = k_in.size(1), key_heads = k_in.size(2), key_dim = k_in.size(3);
  const int64_t heads = v_in.size(2), value_dim = v_in.size(3);
  const int64_t rep = heads / key_heads;
  at::Tensor q = l2norm(heads_first(q_in, rep)), k = l2norm(heads_first(k_in, rep));  // [B, H, T, Dk]
  at::Tensor v = heads_first(v_in), beta = heads_first(beta_in), g = heads_first(g_in);  // [B, H, T, Dv], [B, H, T]
  q = q * (1.0 / std::sqrt(static_cast<double>(key_dim)));

  const int64_t pad = (chunk_size - seq % chunk_size) % chunk_size;
  q = at::constant_pad_nd(q, {0, 0, 0, pad});
  k = at::constant_pad_nd(k, {0, 0, 0, pad});
  v = at::constant_pad_nd(v, {0, 0, 0, pad});
  beta = at::constant_pad_nd(beta, {0, pad});
  g = at::constant_pad_nd(g, {0, pad});
  const int64_t chunks = (seq + pad) / chunk_size, C = chunk_size;

  at::Tensor v_beta = (v * beta.unsqueeze(-1)).view({batch, heads, chunks, C, value_dim});
  at::Tensor k_beta = (k * beta.unsqueeze(-1)).view({batch, heads, chunks, C, key_dim});
  q = q.view({batch, heads, chunks, C, key_dim});
  k = k.view({batch, heads, chunks, C, key_dim});
  at::Tensor cum = g.view({batch, heads, chunks, C}).cumsum(-1);  // log of the decay from the chunk start

  // pairwise[i, j] = exp(cum_i - cum_j) for j <= i, else 0: the decay between positions j and i of a chunk.
  at::Tensor upper = at::ones({C, C}, q.options().dtype(at::kBool)).triu(1);
  at::Tensor pairwise = (cum.unsqueeze(-1) - cum.unsqueeze(-2))
                            .masked_fill(upper, -std::numeric_limits<float>::infinity())
                            .exp();  // [B, H, n, C, C]
  at::Tensor ut_system = at::matmul(k_beta, k.transpose(-1, -2)) * pairwise;
  at::Tensor intra = at::matmul(q, k.transpose(-1, -2)) * pairwise;
  at::Tensor decayed_k_beta = k_beta * cum.exp().unsqueeze(-1);
  // The UT transform: (I + strictly-lower ut_system)^-1 applied by a unit-triangular solve.
  at::Tensor new_values = at::linalg_solve_triangular(ut_system, v_beta, /*upper=*/false, /*left=*/true,
                                                      /*unitriangular=*/true);  // [B, H, n, C, Dv]
  at::Tensor k_cumdecay = at::linalg_solve_triangular(ut_system, decayed_k_beta, false, true, true);

  at::Tensor state = initial_state.defined() ? initial_state.to(at::kFloat)
                                             : at::zeros({batch, heads, key_dim, value_dim}, v.options());
  at::Tensor q_decayed = q * cum.exp().unsqueeze(-1);
  at::Tensor k_to_end = k * (cum.narrow(-1, C - 1, 1) - cum).exp().unsqueeze(-1);
  at::Tensor chunk_decay = cum.select(-1, C - 1).exp().unsqueeze(-1).unsqueeze(-1);  // [B, H, n, 1, 1]
  std::vector<at::Tensor> outs;
  outs.reserve(chunks);
  for (int64_t i = 0; i < chunks; ++i) {  // the sequential scan over chunks
    at::Tensor v_new = new_values.select(2, i) - at::matmul(k_cumdecay.select(2, i), state);  // [B, H, C, Dv]
    outs.push_back(at::matmul(q_decayed.select(2, i), state) + at::matmul(intra.select(2, i), v_new));
    state = state * chunk_decay.select(2, i) + at::matmul(k_to_end.select(2, i).transpose(-1, -2), v_new);
  }
  at::Tensor out = at::stack(outs, 2).view({batch, heads, chunks * C, value_dim}).narrow(2, 0, seq);
  return {out.transpose(1, 2).to(dtype).contiguous(), state};
}

at::Tensor recurrent_gated_delta_step(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                                      const at::Tensor& g_in, const at::Tensor& beta_in, at::Tensor& state) {
  const int64_t rep = v_in.size(2) / k_in.size(2);
  // [B, H, D] (the single token) in float32
  at::Tensor q = l2norm(heads_first(q_in, rep).select(2, 0)), k = l2norm(heads_first(k_in, rep).select(2, 0));
  at::Tensor v = heads_first(v_in).select(2, 0);
  at::Tensor g = heads_first(g_in).select(2, 0), beta = heads_first(beta_in).select(2, 0);  // [B, H]
  q = q * (1.0 / std::sqrt(static_cast<double>(q.size(-1))));
  at::Tensor s = state * g.exp().unsqueeze(-1).unsqueeze(-1);           // [B, H, Dk, Dv]
  at::Tensor kv_mem = (s * k.unsqueeze(-1)).sum(-2);                     // [B, H, Dv]
  at::Tensor delta = (v - kv_mem) * beta.unsqueeze(-1);
  s = s + k.unsqueeze(-1) * delta.unsqueeze(-2);
  state.copy_(s);
  at::Tensor out = (s * q.unsqueeze(-1)).sum(-2);                        // [B, H, Dv]
  return out.unsqueeze(1).to(q_in.scalar_type());                        // [B, 1, H, Dv]
}

at::Tensor causal_conv_step(const at::Tensor& x, at::Tensor& state, const at::Tensor& weight) {
  at::Tensor window = at::cat({state, x.to(state.scalar_type())}, -1);  // [B, C, K]
  state.copy_(window.narrow(-1, 1, window.size(-1) - 1));
  return (window * weight).sum(-1, /*keepdim=*/true);  // [B, C, 1]
}

at::Tensor causal_conv_silu(const at::Tensor& x, const at::Tensor& weight) {
  const int64_t channels = weight.size(0), kernel = weight.size(1), seq = x.size(1);
  const at::Tensor pre = at::conv1d(x.transpose(1, 2), weight.view({channels, 1, kernel}), /*bias=*/{}, /*stride=*/1,
                                    /*padding=*/kernel - 1, /*dilation=*/1, /*groups=*/channels)
                             .narrow(-1, 0, seq);  // [B, C, T]
  return at::silu(pre).transpose(1, 2);  // [B, T, C]
}

at::Tensor GatedRmsNorm::forward(const at::Tensor& x, const at::Tensor& gate) const {
  // float32 on the CPU: the same products as two fused ops, (weight * x̂) by rmsnorm_cpu, then silu(gate) times it by
  // swiglu, each one pass forward and one backward instead of the formula's nine elementwise ops and their backwards.
  if (ops::rmsnorm_cpu_applies(x, weight_) && ops::swiglu_is_fused(gate, x)) {
    return ops::swiglu(gate, ops::rmsnorm_cpu(x, weight_, eps_));
  }
  at::Tensor normed = rms_normalized_f32(x, eps_).to(x.scalar_type());
  return (weight_ * normed * at::silu(gate.to(at::kFloat))).to(x.scalar_type());
}

GatedDeltaNet::GatedDeltaNet(const ModelConfig& config, BuildContext& ctx, const std::string& prefix)
    : tp_(ctx.tensor_parallel),
      key_heads_(config.linear_num_key_heads / tp_.size()),
      value_heads_(config.linear_num_value_heads / tp_.size()),
      key_dim_(config.linear_key_head_dim),
      value_dim_(config.linear_value_head_dim),
      kernel_(config.linear_conv_kernel_dim),
      qkv_sections_({config.linear_num_key_heads * key_dim_, config.linear_num_key_heads * key_dim_,
                     config.linear_num_value_heads * value_dim_}),
      in_proj_qkv_(make_sectioned_linear(ctx, prefix + ".in_proj_qkv", qkv_sections_, config.hidden_size)),
      in_proj_z_(make_parallel_linear(ctx, prefix + ".in_proj_z", config.linear_num_value_heads * value_dim_,
                                      config.hidden_size, false, dist::TpSplit::kColumn)),
      in_proj_b_(make_parallel_linear(ctx, prefix + ".in_proj_b", config.linear_num_value_heads, config.hidden_size,
                                      false, dist::TpSplit::kColumn)),
      in_proj_a_(make_parallel_linear(ctx, prefix + ".in_proj_a", config.linear_num_value_heads, config.hidden_size,
                                      false, dist::TpSplit::kColumn)),
      out_proj_(make_parallel_linear(ctx, prefix + ".out_proj", config.hidden_size,
                                     config.linear_num_value_heads * value_dim_, false, dist::TpSplit::kRow)),
      conv_weight_(ctx.weights.take_sections(
          prefix + ".conv1d.weight",
          {2 * config.linear_num_key_heads * key_dim_ + config.linear_num_value_heads * value_dim_, 1, kernel_}, 0,
          qkv_sections_, tp_)),
      a_log_(ctx.weights.take_part(prefix + ".A_log", {config.linear_num_value_heads}, 0, tp_)),
      dt_bias_(ctx.weights.take_part(prefix + ".dt_bias", {config.linear_num_value_heads}, 0, tp_)),
      norm_(ctx.weights.take(prefix + ".norm.weight", {value_dim_}), config.rms_norm_eps) {}

at::Tensor GatedDeltaNet::conv(const at::Tensor& qkv, const KvCacheView* cache, int64_t layer) const {
  const int64_t batch = qkv.size(0), seq = qkv.size(1), channels = qkv.size(2);
  at::Tensor x = qkv.transpose(1, 2);  // [B, C, T]
  const at::Tensor weight = conv_weight_.view({channels, kernel_});
  if (cache != nullptr && cache->decode) {
    SKYRL_TX_INTERNAL_ASSERT(seq == 1, "decode feeds one token per row");
    at::Tensor state = cache->conv_states->at(layer).narrow(0, 0, batch);  // [B, C, K - 1], cache rows [0, B)
    const at::Tensor out = ops::conv_step_cpu_applies(state, weight) ? ops::conv_step_cpu(x, state, weight)
                                                                     : causal_conv_step(x, state, weight);
    return at::silu(out).transpose(1, 2);  // [B, 1, C]
  }
  if (cache != nullptr) {
    SKYRL_TX_CHECK(!cache->extend, Internal, "Gated DeltaNet layers have no prefix cache (it is off for them)");
    SKYRL_TX_INTERNAL_ASSERT(cache->lengths.defined(), "a prefill into a recurrent state needs each row's length");
    // Each row's state: its last kernel - 1 real inputs, zeros before the start (left-padded window).
    at::Tensor padded = at::constant_pad_nd(x, {kernel_ - 1, 0});  // [B, C, T + K - 1]
    at::Tensor idx = (cache->lengths.view({batch, 1, 1}) + at::arange(kernel_ - 1, cache->lengths.options()))
                         .expand({batch, channels, kernel_ - 1});
    at::Tensor states = cache->conv_states->at(layer);  // a handle: shares the cache's storage
    states.index_copy_(0, cache->rows, padded.gather(2, idx).to(states.scalar_type()));
  }
  return ops::conv_silu_cpu_applies(qkv, weight) ? ops::conv_silu_cpu(qkv, weight) : causal_conv_silu(qkv, weight);
}

at::Tensor GatedDeltaNet::forward(const at::Tensor& x, const at::Tensor& /*cos*/, const at::Tensor& /*sin*/,
                                  const AttentionMask& mask, const lora::AdapterSegments& segments,
                                  const KvCacheView* cache, int64_t layer) const {
  SKYRL_TX_INTERNAL_ASSERT(!mask.packed() || cache == nullptr || cache->token_rows.defined(),
                           "packed sequences write the recurrent cache per sequence (a packed prefill) or not at all");
  const int64_t batch = x.size(0), seq = x.size(1);
  at::Tensor flat = tp_.copy_in(x.reshape({batch * seq, x.size(2)}));  // [N, hidden]
  at::Tensor qkv = in_proj_qkv_.forward(flat, segments).view({batch, seq, -1});  // [B, T, conv_dim]
  // Packed sequences: each one's conv window and delta-rule state start from zeros at its first token, exactly as
  // if it ran alone (the conv's left padding, the rule's zero initial state); nothing carries across a boundary.
  // Each run of equal-length sequences runs as one batch ([count, len, ...] views of the row); what is token-wise
  // (the projections, the norm) runs once over the whole row.
  const std::vector<SequenceRun> runs = mask.packed() ? equal_length_runs(mask) : std::vector<SequenceRun>{};
  auto per_run = [&](const std::function<at::Tensor(const SequenceRun&)>& run_one) {  // [1, N, ...] joined on dim 1
    std::vector<at::Tensor> parts;
    for (const SequenceRun& run : runs) parts.push_back(run_one(run).flatten(0, 1).unsqueeze(0));
    return parts.size() == 1 ? parts[0] : at::cat(parts, 1);
  };
  // [1, N, ...] → [count, len, ...]: a run's sequences as a batch.
  auto as_batch = [](const at::Tensor& t, const SequenceRun& run) {
    return t.narrow(1, run.begin, run.count * run.length).squeeze(0).unflatten(0, {run.count, run.length});
  };
  // A packed prefill's run as a padded prefill of its sequences: each one's cache row (its first token's) and length,
  // so each sequence's conv window and delta-rule state are kept at its own end.
  auto run_view = [&](const SequenceRun& run) {
    KvCacheView view = *cache;
    view.rows = cache->token_rows.narrow(0, run.begin, run.count * run.length)
                    .view({run.count, run.length})
                    .select(1, 0)
                    .contiguous();  // [count]
    view.lengths = at::full({run.count}, run.length, view.rows.options());
    return view;
  };
  at::Tensor mixed = mask.packed() ? per_run([&](const SequenceRun& run) {
    if (cache == nullptr) return conv(as_batch(qkv, run), nullptr, layer);
    const KvCacheView view = run_view(run);
    return conv(as_batch(qkv, run), &view, layer);
  })
                                   : conv(qkv, cache, layer);  // [B, T, conv_dim]
  const int64_t qk_width = key_heads_ * key_dim_;
  at::Tensor q = mixed.narrow(-1, 0, qk_width).reshape({batch, seq, key_heads_, key_dim_});
  at::Tensor k = mixed.narrow(-1, qk_width, qk_width).reshape({batch, seq, key_heads_, key_dim_});
  at::Tensor v = mixed.narrow(-1, 2 * qk_width, value_heads_ * value_dim_).reshape({batch, seq, value_heads_, value_dim_});
  at::Tensor beta = at::sigmoid(in_proj_b_.forward(flat, segments)).view({batch, seq, value_heads_});
  // g = -exp(A_log) * softplus(a + dt_bias), the per-head log decay, in float32.
  at::Tensor a = in_proj_a_.forward(flat, segments).view({batch, seq, value_heads_});
  at::Tensor g = -a_log_.to(at::kFloat).exp() * at::softplus(a.to(at::kFloat) + dt_bias_);

  at::Tensor core;  // [B, T, Hv, Dv]
  if (cache != nullptr && cache->decode) {
    at::Tensor state = cache->recurrent_states->at(layer).narrow(0, 0, batch);  // [B, Hv, Dk, Dv], a view
    core = ops::gated_delta_step_cpu_applies(state) ? ops::gated_delta_step_cpu(q, k, v, g, beta, state)
                                                    : recurrent_gated_delta_step(q, k, v, g, beta, state);
  } else if (mask.packed()) {
    core = per_run([&](const SequenceRun& run) {
      auto [out, state] = chunk_gated_delta_rule(as_batch(q, run), as_batch(k, run), as_batch(v, run),
                                                 as_batch(g, run), as_batch(beta, run), kChunkSize, at::Tensor());
      if (cache != nullptr) cache->recurrent_states->at(layer).index_copy_(0, run_view(run).rows, state);
      return out;
    });
  } else if (cache != nullptr) {
    // Padding after a row's end must not move its state: no decay (g = 0) and no write (beta = 0) there.
    at::Tensor real = (at::arange(seq, cache->lengths.options()).unsqueeze(0) < cache->lengths.unsqueeze(1))
                          .unsqueeze(-1);  // [B, T, 1]
    auto [out, state] = chunk_gated_delta_rule(q, k, v, g * real, beta * real, kChunkSize, at::Tensor());
    core = out;
    at::Tensor states = cache->recurrent_states->at(layer);
    states.index_copy_(0, cache->rows, state);
  } else {
    core = chunk_gated_delta_rule(q, k, v, g, beta, kChunkSize, at::Tensor()).first;
  }
  at::Tensor z = in_proj_z_.forward(flat, segments);  // [N, Hv * Dv], the output gate
  at::Tensor normed = norm_.forward(core.reshape({-1, value_dim_}), z.reshape({-1, value_dim_}));
  at::Tensor out = out_proj_.forward(normed.reshape({batch * seq, value_heads_ * value_dim_}), segments);
  return tp_.reduce_out(out).view({batch, seq, -1});  // [B, T, hidden], every rank's heads summed
}

void GatedDeltaNet::collect_lora(const std::string& prefix, std::vector<NamedLoraModule>& out) {
  const bool split = tp_.enabled();
  const dist::TpSplit column = split ? dist::TpSplit::kColumn : dist::TpSplit::kReplicated;
  NamedLoraModule qkv{prefix + ".in_proj_qkv", LoraGroup::kAttention, &in_proj_qkv_, column};
  if (split) qkv.sections = qkv_sections_;
  out.push_back(std::move(qkv));
  out.push_back({prefix + ".in_proj_z", LoraGroup::kAttention, &in_proj_z_, column});
  out.push_back({prefix + ".in_proj_b", LoraGroup::kAttention, &in_proj_b_, column});
  out.push_back({prefix + ".in_proj_a", LoraGroup::kAttention, &in_proj_a_, column});
  out.push_back({prefix + ".out_proj", LoraGroup::kAttention, &out_proj_,
                 split ? dist::TpSplit::kRow : dist::TpSplit::kReplicated});
}

void GatedDeltaNet::collect_parameters(const std::string& prefix, std::vector<NamedParameter>& out) const {
  for (const auto& [name, linear] : {std::pair{"in_proj_qkv", &in_proj_qkv_}, {"in_proj_z", &in_proj_z_},
                                     {"in_proj_b", &in_proj_b_}, {"in_proj_a", &in_proj_a_}, {"out_proj", &out_proj_}}) {
    out.emplace_back(prefix + "." + name + ".weight", linear->weight());
  }
  out.emplace_back(prefix + ".conv1d.weight", conv_weight_);
  out.emplace_back(prefix + ".A_log", a_log_);
  out.emplace_back(prefix + ".dt_bias", dt_bias_);
  out.emplace_back(prefix + ".norm.weight", norm_.weight());
}

}  // namespace skyrl_tx::models
