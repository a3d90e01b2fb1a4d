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

// DeepSeek's absorbed MLA decode: for head h, q_nope . (W_UK_h latent_j) = (W_UK_h^T q_nope) . latent_j, and the
// attended values sum_j p_j W_UV_h latent_j = W_UV_h (sum_j p_j latent_j). So the query moves into the latent space
// once (through kv_b_proj's key rows, adapters included), attention runs over the cached [latent | rotated key]
// entries as one KV head shared by every query head, and the attended latent goes out through the value rows. A
// step reads each cached entry once instead of expanding all L of them through kv_b_proj (L x kv_lora x heads x
// (nope + v) multiply-adds per row per layer). Adapters act through kv_b_proj's row-dense inference factors (B
// pre-scaled, kept in the activation dtype) and the row-dense form of `segments`: each row keeps its slot's columns.
at::Tensor MlaAttention::absorbed_decode(const at::Tensor& query, const at::Tensor& past, const at::Tensor& attend_mask,
                                         const lora::AdapterSegments& segments) const {
  const at::ScalarType dtype = query.scalar_type();
  const at::Tensor w = kv_b_proj_.weight().to(dtype).view({heads_, nope_ + v_dim_, kv_lora_rank_});
  const at::Tensor q = query.select(2, 0);                             // [B, heads, nope + rope]
  const at::Tensor q_nope = q.narrow(-1, 0, nope_).transpose(0, 1);    // [heads, B, nope]
  at::Tensor q_latent = at::bmm(q_nope, w.narrow(1, 0, nope_));        // [heads, B, kv_lora]: W_UK^T q_nope
  at::Tensor a_all, b_all, row_columns;  // adapters: [S * R, kv_lora], [heads, nope + v, S * R] scaled, [B, S * R]
  if (!segments.only_base()) {
    const at::Tensor& stacked_a = kv_b_proj_.stacked_a();  // [S, R, kv_lora]
    const int64_t slots = stacked_a.size(0), max_rank = stacked_a.size(1);
    at::Tensor b_scaled;  // [heads * (nope + v), S * R]
    std::tie(a_all, b_scaled) = kv_b_proj_.inference_factors(dtype);
    b_all = b_scaled.view({heads_, nope_ + v_dim_, slots * max_rank});
    // 0/1 on the row's slot's columns (exact in any dtype)
    row_columns = segments.slot_columns_on(query.device(), slots, max_rank).to(dtype);
    // + A^T (scaling B_UK^T q_nope): [heads, B, S * R] masked to each row's slot, then into the latent space
    q_latent = q_latent + at::matmul(at::bmm(q_nope, b_all.narrow(1, 0, nope_)) * row_columns, a_all);
  }
  // [B, heads, 1, kv_lora + rope] against the entries [B, 1, L, kv_lora + rope]; the values are their latents
  const at::Tensor q_absorbed = at::cat({q_latent.transpose(0, 1), q.narrow(-1, nope_, rope_)}, -1).unsqueeze(2);
  const at::Tensor attended = at::scaled_dot_product_attention(q_absorbed, past, past.narrow(-1, 0, kv_lora_rank_),
                                                               attend_mask, 0.0, false, scale_, /*enable_gqa=*/true)
                                  .select(2, 0)
                                  .transpose(0, 1);  // [heads, B, kv_lora]
  at::Tensor out = at::bmm(attended, w.narrow(1, nope_, v_dim_).transpose(1, 2));  // [heads, B, v]: W_UV o
  if (a_all.defined()) {  // + scaling B_UV (A o)
    out = out + at::bmm(at::matmul(attended, a_all.t()) * row_columns, b_all.narrow(1, nope_, v_dim_).transpose(1, 2));
  }
  return out.transpose(0, 1).unsqueeze(2);  // [B, heads, 1, v]
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
  at::Tensor k, v, attn;  // attn: [B, heads, T, v]
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
    attn = absorbed_decode(query, past, cache->attend_mask, segments);            // [B, heads, 1, v]
  }
  const bool causal = !attn_mask.has_value();
  // [B, heads, T, v]; V is narrower than Q and K, which SDPA allows.
  if (!attn.defined()) {
    attn = mask.packed() ? packed_causal_attention(query, k, v, mask, scale_)
                         : at::scaled_dot_product_attention(query, k, v, attn_mask, 0.0, causal, scale_);
  }
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
