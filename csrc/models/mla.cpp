// MlaAttention: DeepSeek's multi-head latent attention; the KV cache holds the compressed latent, not K and V.
#include "models/mla.h"

#include <cmath>

#include "common/errors.h"
#include "models/packed_attention.h"
#include "models/rope.h"

namespace skyrl_tx::models {
namespace {

double yarn_mscale(double scale, double mscale) { return scale <= 1 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0; }

// transformers' yarn_apply_mscale: with YaRN and mscale_all_dim, the softmax scale gains mscale^2.
double softmax_scale(const ModelConfig& c) {
  double scale = 1.0 / std::sqrt(static_cast<double>(c.qk_nope_head_dim + c.qk_rope_head_dim));
  if (c.rope_scaling.type != "default" && c.rope_scaling.mscale_all_dim != 0) {
    const double m = yarn_mscale(c.rope_scaling.factor, c.rope_scaling.mscale_all_dim);
    scale *= m * m;
  }
  return scale;
}

}  // namespace

lora::AdapterSegments repeat_tokens(const lora::AdapterSegments& segments, int64_t factor) {
  if (segments.row_dense()) {
    return lora::AdapterSegments::row_dense(segments.slot_columns().repeat_interleave(factor, 0));
  }
  std::vector<lora::Segment> out;
  for (const lora::Segment& s : segments.segments()) out.push_back({s.slot, s.begin * factor, s.length * factor});
  return lora::AdapterSegments(std::move(out));
}

MlaAttention::MlaAttention(const ModelConfig& config, BuildContext& ctx, const std::string& prefix)
    : tp_(ctx.tensor_parallel),
      heads_(config.num_attention_heads / tp_.size()),
      kv_lora_rank_(config.kv_lora_rank),
      nope_(config.qk_nope_head_dim),
      rope_(config.qk_rope_head_dim),
      v_dim_(config.v_head_dim),
      interleave_(config.rope_interleave),
      scale_(softmax_scale(config)),
      kv_a_proj_(make_lora_linear(ctx, prefix + ".kv_a_proj_with_mqa", kv_lora_rank_ + rope_, config.hidden_size,
                                  config.attention_bias)),
      // Rows are head-major ([heads, nope + v] and [heads, nope + rope] for q): a contiguous shard is whole heads.
      kv_b_proj_(make_parallel_linear(ctx, prefix + ".kv_b_proj", config.num_attention_heads * (nope_ + v_dim_),
                                      kv_lora_rank_, false, dist::TpSplit::kColumn)),
      o_proj_(make_parallel_linear(ctx, prefix + ".o_proj", config.hidden_size, config.num_attention_heads * v_dim_,
                                   config.attention_bias, dist::TpSplit::kRow, &o_bias_)),
      // transformers builds kv_a_layernorm and q_a_layernorm with the default eps 1e-6, not rms_norm_eps.
      kv_a_norm_(ctx.weights.take(prefix + ".kv_a_layernorm.weight", {kv_lora_rank_}), 1e-6) {
  const int64_t q_out = config.num_attention_heads * (nope_ + rope_);  // whole; each rank takes its heads
  if (config.q_lora_rank > 0) {
    q_a_proj_ = std::make_unique<lora::LoraLinear>(
        make_lora_linear(ctx, prefix + ".q_a_proj", config.q_lora_rank, config.hidden_size, config.attention_bias));
    // transformers' DeepseekV3RMSNorm default eps (1e-6), not rms_norm_eps.
    q_a_norm_ = std::make_unique<RmsNorm>(ctx.weights.take(prefix + ".q_a_layernorm.weight", {config.q_lora_rank}),
                                          1e-6);
    q_b_proj_ = std::make_unique<lora::LoraLinear>(
        make_parallel_linear(ctx, prefix + ".q_b_proj", q_out, config.q_lora_rank, false, dist::TpSplit::kColumn));
  } else {
    q_proj_ = std::make_unique<lora::LoraLinear>(
        make_parallel_linear(ctx, prefix + ".q_proj", q_out, config.hidden_size, false, dist::TpSplit::kColumn));
  }
}

at::Tensor MlaAttention::rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) const {
  return interleave_ ? RotaryEmbedding::apply_interleaved(x, cos, sin) : RotaryEmbedding::apply(x, cos, sin);
}

std::pair<at::Tensor, at::Tensor> MlaAttention::expand(const at::Tensor& latent, const at::Tensor& k_rot,
                                                       const lora::AdapterSegments& segments) const {
  const int64_t batch = latent.size(0), len = latent.size(1);
  at::Tensor kv = kv_b_proj_.forward(latent.reshape({batch * len, kv_lora_rank_}), segments)
                      .view({batch, len, heads_, nope_ + v_dim_})
                      .transpose(1, 2);  // [B, heads, L, nope + v]
  at::Tensor k_nope = kv.narrow(-1, 0, nope_), v = kv.narrow(-1, nope_, v_dim_);
  at::Tensor k = at::cat({k_nope, k_rot.expand({batch, heads_, len, rope_})}, -1);  // [B, heads, L, nope + rope]
  return {k, v};
}

at::Tensor MlaAttention::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                 const AttentionMask& mask, const lora::AdapterSegments& segments,
                                 const KvCacheView* cache, int64_t layer) const {
  SKYRL_TX_INTERNAL_ASSERT(!mask.packed() || cache == nullptr || cache->token_rows.defined(),
                           "packed sequences write the KV cache by token (a packed prefill) or not at all");
  const int64_t batch = x.size(0), seq = x.size(1);
  // [N, hidden]; its gradient sums every rank's (each one's heads' share, through the whole q_a / kv_a path too)
  at::Tensor flat = tp_.copy_in(x.reshape({batch * seq, x.size(2)}));
  at::Tensor q = q_proj_ ? q_proj_->forward(flat, segments)
                         : q_b_proj_->forward(q_a_norm_->forward(q_a_proj_->forward(flat, segments)), segments);
  q = q.view({batch, seq, heads_, nope_ + rope_}).transpose(1, 2);  // [B, heads, T, nope + rope]
  at::Tensor compressed = kv_a_proj_.forward(flat, segments);      // [N, kv_lora_rank + rope]
  at::Tensor latent = kv_a_norm_.forward(compressed.narrow(1, 0, kv_lora_rank_)).view({batch, seq, kv_lora_rank_});
  at::Tensor k_rot = rotate(compressed.narrow(1, kv_lora_rank_, rope_).view({batch, 1, seq, rope_}), cos, sin);
  at::Tensor query = at::cat({q.narrow(-1, 0, nope_), rotate(q.narrow(-1, nope_, rope_), cos, sin)}, -1);

  std::optional<at::Tensor> attn_mask = mask.mask.defined() ? std::optional(mask.mask) : std::nullopt;
  at::Tensor k, v;
  if (cache != nullptr && cache->extend) {  // after a cached prefix (one row, one adapter)
    const int64_t row = cache->extend_row, start = cache->extend_start, len = start + seq;
    at::Tensor store = cache->keys->at(layer);  // [rows, 1, max_len, kv_lora_rank + rope]; shares storage
    store.select(0, row).narrow(1, start, seq).copy_(at::cat({latent.unsqueeze(1), k_rot}, -1).select(0, 0));
    at::Tensor past = store.narrow(0, row, 1).narrow(2, 0, len);  // [1, 1, L, D]
    SKYRL_TX_CHECK(!segments.row_dense() && segments.segments().size() == 1, Internal,
                   "MLA extend: expects one row under one adapter");
    std::tie(k, v) = expand(past.select(1, 0).narrow(-1, 0, kv_lora_rank_), past.narrow(-1, kv_lora_rank_, rope_),
                            lora::AdapterSegments::uniform(segments.segments().front().slot, len));
    attn_mask = cache->attend_mask;
  } else if (cache == nullptr || !cache->decode) {
    if (cache != nullptr) {  // prefill: cache latent + rotated RoPE key, [B, 1, T, kv_lora_rank + rope]
      at::Tensor entry = at::cat({latent.unsqueeze(1), k_rot}, -1);
      if (cache->token_rows.defined()) {  // packed: [1, 1, total, D] → each token to its row and position
        cache->keys->at(layer).select(1, 0).index_put_({cache->token_rows, cache->token_positions},
                                                       entry.select(0, 0).select(0, 0));
      } else {
        cache->keys->at(layer).narrow(2, 0, seq).index_copy_(0, cache->rows, entry);
      }
    }
    std::tie(k, v) = expand(latent, k_rot, segments);
  } else {
    using at::indexing::Slice;
    at::Tensor store = cache->keys->at(layer);  // [rows, 1, max_len, kv_lora_rank + rope]; shares storage
    at::Tensor batch_rows =
        cache->batch_rows.defined() ? cache->batch_rows : at::arange(batch, cache->positions.options());
    store.index_put_({batch_rows, Slice(), cache->positions}, at::cat({latent, k_rot.squeeze(1)}, -1));  // [B, 1, D]
    at::Tensor past = store.narrow(0, 0, batch).narrow(2, 0, cache->attend_len);  // [B, 1, L, D]
    const int64_t len = cache->attend_len;
    std::tie(k, v) = expand(past.select(1, 0).narrow(-1, 0, kv_lora_rank_), past.narrow(-1, kv_lora_rank_, rope_),
                            repeat_tokens(segments, len));
    attn_mask = cache->attend_mask;
  }
  const bool causal = !attn_mask.has_value();
  // [B, heads, T, v]; V is narrower than Q and K, which SDPA allows.
  at::Tensor attn = mask.packed() ? packed_causal_attention(query, k, v, mask, scale_)
                                  : at::scaled_dot_product_attention(query, k, v, attn_mask, 0.0, causal, scale_);
  at::Tensor merged = attn.transpose(1, 2).reshape({batch * seq, heads_ * v_dim_});
  at::Tensor out = tp_.reduce_out(o_proj_.forward(merged, segments));  // [N, hidden]
  if (o_bias_.defined()) out = out + o_bias_;
  return out.view({batch, seq, -1});
}

void MlaAttention::collect_lora(const std::string& prefix, std::vector<NamedLoraModule>& out) {
  const auto split = [&](dist::TpSplit s) { return tp_.enabled() ? s : dist::TpSplit::kReplicated; };
  if (q_proj_) out.push_back({prefix + ".q_proj", LoraGroup::kAttention, q_proj_.get(), split(dist::TpSplit::kColumn)});
  if (q_a_proj_) {
    out.push_back({prefix + ".q_a_proj", LoraGroup::kAttention, q_a_proj_.get(), split(dist::TpSplit::kPartial)});
  }
  if (q_b_proj_) {
    out.push_back({prefix + ".q_b_proj", LoraGroup::kAttention, q_b_proj_.get(), split(dist::TpSplit::kColumn)});
  }
  out.push_back({prefix + ".kv_a_proj_with_mqa", LoraGroup::kAttention, &kv_a_proj_, split(dist::TpSplit::kPartial)});
  out.push_back({prefix + ".kv_b_proj", LoraGroup::kAttention, &kv_b_proj_, split(dist::TpSplit::kColumn)});
  out.push_back({prefix + ".o_proj", LoraGroup::kAttention, &o_proj_, split(dist::TpSplit::kRow)});
}

void MlaAttention::collect_parameters(const std::string& prefix, std::vector<NamedParameter>& out) const {
  auto linear = [&](const std::string& name, const lora::LoraLinear* m) {
    if (m == nullptr) return;
    out.emplace_back(prefix + "." + name + ".weight", m->weight());
    if (m->bias().defined()) out.emplace_back(prefix + "." + name + ".bias", m->bias());
  };
  linear("q_proj", q_proj_.get());
  linear("q_a_proj", q_a_proj_.get());
  if (q_a_norm_) out.emplace_back(prefix + ".q_a_layernorm.weight", q_a_norm_->weight());
  linear("q_b_proj", q_b_proj_.get());
  linear("kv_a_proj_with_mqa", &kv_a_proj_);
  out.emplace_back(prefix + ".kv_a_layernorm.weight", kv_a_norm_.weight());
  linear("kv_b_proj", &kv_b_proj_);
  linear("o_proj", &o_proj_);
  if (o_bias_.defined()) out.emplace_back(prefix + ".o_proj.bias", o_bias_);
}

}  // namespace skyrl_tx::models
