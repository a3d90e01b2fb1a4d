// Decoder building blocks: RMSNorm, the token-mixer and MLP seams (GQA, SwiGLU), and the decoder layer.
#include "models/layers.h"

#include <cmath>

#include "common/errors.h"
#include "models/architectures.h"
#include "models/gated_deltanet.h"
#include "models/mla.h"
#include "models/moe.h"
#include "models/packed_attention.h"
#include "models/rope.h"
#include "ops/decode_attention_cpu.h"
#include "ops/fused_rmsnorm.h"
#include "ops/rmsnorm_cpu.h"
#include "ops/swiglu.h"

namespace skyrl_tx::models {

lora::LoraLinear make_lora_linear(BuildContext& ctx, const std::string& prefix, int64_t out, int64_t in, bool bias) {
  at::Tensor w = ctx.weights.take(prefix + ".weight", {out, in});
  at::Tensor b = bias ? ctx.weights.take(prefix + ".bias", {out}) : at::Tensor();
  return lora::LoraLinear(std::move(w), std::move(b), ctx.num_slots, ctx.max_rank);
}

lora::LoraLinear make_parallel_linear(BuildContext& ctx, const std::string& prefix, int64_t out, int64_t in,
                                      bool bias, dist::TpSplit split, at::Tensor* row_bias) {
  const dist::TensorParallel& tp = ctx.tensor_parallel;
  if (!tp.enabled() || split == dist::TpSplit::kReplicated) return make_lora_linear(ctx, prefix, out, in, bias);
  if (split == dist::TpSplit::kColumn) {  // [out / tp, in], bias [out / tp]
    at::Tensor w = ctx.weights.take_part(prefix + ".weight", {out, in}, 0, tp);
    at::Tensor b = bias ? ctx.weights.take_part(prefix + ".bias", {out}, 0, tp) : at::Tensor();
    return lora::LoraLinear(std::move(w), std::move(b), ctx.num_slots, ctx.max_rank);
  }
  SKYRL_TX_INTERNAL_ASSERT(row_bias != nullptr || !bias, "row-parallel linear with a bias needs row_bias");
  if (bias) *row_bias = ctx.weights.take(prefix + ".bias", {out});  // replicated
  at::Tensor w = ctx.weights.take_part(prefix + ".weight", {out, in}, 1, tp);  // [out, in / tp]
  return lora::LoraLinear(std::move(w), at::Tensor(), ctx.num_slots, ctx.max_rank);
}

lora::LoraLinear make_sectioned_linear(BuildContext& ctx, const std::string& prefix,
                                       const std::vector<int64_t>& sections, int64_t in) {
  int64_t out = 0;
  for (int64_t n : sections) out += n;
  at::Tensor w = ctx.weights.take_sections(prefix + ".weight", {out, in}, 0, sections, ctx.tensor_parallel);
  return lora::LoraLinear(std::move(w), at::Tensor(), ctx.num_slots, ctx.max_rank);
}

at::Tensor rms_normalized_f32(const at::Tensor& x, double eps) {
  at::Tensor x32 = x.to(at::kFloat);
  return x32 * at::rsqrt(x32.pow(2).mean(-1, /*keepdim=*/true) + eps);
}

at::Tensor RmsNorm::forward(const at::Tensor& x) const {
  if (zero_centered_) {  // (x * w) in float32, then the cast (Qwen3_5RMSNorm), unlike Llama's cast-then-scale
    const at::Tensor scale = 1.0 + weight_.to(at::kFloat);  // [dim] float32; the weight's gradient flows through it
    // float32 activations: the cast is a no-op, so this is the fused kernel's w * (x * rstd) with w = 1 + weight.
    if (ops::rmsnorm_cpu_applies(x, scale)) return ops::rmsnorm_cpu(x, scale, eps_);
    return (rms_normalized_f32(x, eps_) * scale).to(x.scalar_type());
  }
  if (ops::can_use_fused_rmsnorm(x)) return ops::fused_rmsnorm(x, weight_, eps_);
  if (ops::rmsnorm_cpu_applies(x, weight_)) return ops::rmsnorm_cpu(x, weight_, eps_);
  return weight_ * rms_normalized_f32(x, eps_).to(x.scalar_type());
}

Attention::Attention(const ModelConfig& config, BuildContext& ctx, const std::string& prefix)
    : tp_(ctx.tensor_parallel),
      num_heads_(config.num_attention_heads / tp_.size()),
      num_kv_heads_(config.num_key_value_heads / tp_.size()),
      head_dim_(config.resolved_head_dim()),
      gated_(find_architecture(config.architecture).attention == AttentionKind::kGatedGqa),
      // Rows are head-major (a gated head's [query | gate] included), so a contiguous row shard is whole heads.
      q_proj_(make_parallel_linear(ctx, prefix + ".q_proj",
                                   config.num_attention_heads * head_dim_ * (gated_ ? 2 : 1), config.hidden_size,
                                   config.attention_bias, dist::TpSplit::kColumn)),
      k_proj_(make_parallel_linear(ctx, prefix + ".k_proj", config.num_key_value_heads * head_dim_,
                                   config.hidden_size, config.attention_bias, dist::TpSplit::kColumn)),
      v_proj_(make_parallel_linear(ctx, prefix + ".v_proj", config.num_key_value_heads * head_dim_,
                                   config.hidden_size, config.attention_bias, dist::TpSplit::kColumn)),
      o_proj_(make_parallel_linear(ctx, prefix + ".o_proj", config.hidden_size,
                                   config.num_attention_heads * head_dim_, config.attention_bias,
                                   dist::TpSplit::kRow, &o_bias_)) {
  if (config.qk_norm) {
    const bool zero_centered = find_architecture(config.architecture).zero_centered_norm;
    qk_norm_.emplace_back(ctx.weights.take(prefix + ".q_norm.weight", {head_dim_}), config.rms_norm_eps,
                          zero_centered);
    qk_norm_.emplace_back(ctx.weights.take(prefix + ".k_norm.weight", {head_dim_}), config.rms_norm_eps,
                          zero_centered);
  }
}

at::Tensor Attention::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                              const AttentionMask& mask, const lora::AdapterSegments& segments,
                              const KvCacheView* cache, int64_t layer) const {
  SKYRL_TX_INTERNAL_ASSERT(!mask.packed() || cache == nullptr || cache->token_rows.defined(),
                           "packed sequences write the KV cache by token (a packed prefill) or not at all");
  const int64_t batch = x.size(0), seq = x.size(1);
  at::Tensor flat = tp_.copy_in(x.reshape({batch * seq, x.size(2)}));  // [N, hidden]
  // q: [B, T, heads, D]; k, v: [B, T, kv_heads, D]
  at::Tensor q = q_proj_.forward(flat, segments);
  at::Tensor gate;  // gated: [B * T, heads * D], each head's second half of q_proj's [query | gate]
  if (gated_) {
    at::Tensor both = q.view({batch, seq, num_heads_, 2 * head_dim_});
    gate = both.narrow(-1, head_dim_, head_dim_).reshape({batch * seq, num_heads_ * head_dim_});
    q = both.narrow(-1, 0, head_dim_);
  }
  q = q.view({batch, seq, num_heads_, head_dim_});
  at::Tensor k = k_proj_.forward(flat, segments).view({batch, seq, num_kv_heads_, head_dim_});
  at::Tensor v = v_proj_.forward(flat, segments).view({batch, seq, num_kv_heads_, head_dim_});
  if (!qk_norm_.empty()) {  // Qwen3: per-head RMSNorm before RoPE
    q = qk_norm_[0].forward(q);
    k = qk_norm_[1].forward(k);
  }
  // [B, heads, T, D]
  q = RotaryEmbedding::apply(q.transpose(1, 2), cos, sin);
  k = RotaryEmbedding::apply(k.transpose(1, 2), cos, sin);
  v = v.transpose(1, 2);
  std::optional<at::Tensor> attn_mask = mask.mask.defined() ? std::optional(mask.mask) : std::nullopt;
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim_));
  at::Tensor attn;  // [B, heads, T, D]
  if (cache != nullptr) {
    at::Tensor k_cache = cache->keys->at(layer);  // [rows, kv_heads, max_len, D]; a handle, shares storage
    at::Tensor v_cache = cache->values->at(layer);
    if (cache->extend) {  // after a cached prefix: write this row's new keys, attend to the prefix and them
      const int64_t row = cache->extend_row, start = cache->extend_start;
      k_cache.select(0, row).narrow(1, start, seq).copy_(k.select(0, 0));  // [kv_heads, T, D]
      v_cache.select(0, row).narrow(1, start, seq).copy_(v.select(0, 0));
      k = k_cache.narrow(0, row, 1).narrow(2, 0, start + seq);  // [1, kv_heads, start + T, D]
      v = v_cache.narrow(0, row, 1).narrow(2, 0, start + seq);
      attn_mask = cache->attend_mask;
    } else if (cache->token_rows.defined()) {  // packed prefill: k, v [1, kv_heads, total, D]
      using at::indexing::Slice;
      k_cache.index_put_({cache->token_rows, Slice(), cache->token_positions}, k.select(0, 0).transpose(0, 1));
      v_cache.index_put_({cache->token_rows, Slice(), cache->token_positions}, v.select(0, 0).transpose(0, 1));
    } else if (!cache->decode) {
      k_cache.narrow(2, 0, seq).index_copy_(0, cache->rows, k);
      v_cache.narrow(2, 0, seq).index_copy_(0, cache->rows, v);
    } else {
      using at::indexing::Slice;
      at::Tensor batch_rows =
          cache->batch_rows.defined() ? cache->batch_rows : at::arange(batch, cache->positions.options());
      if (ops::decode_attention_cpu_applies(q, k_cache, v_cache)) {  // the write and the attention in one pass
        attn = ops::decode_attention_cpu(q, k, v, k_cache, v_cache, batch_rows, cache->positions, cache->attend_len,
                                         scale);
      } else {
        k_cache.index_put_({batch_rows, Slice(), cache->positions}, k.select(2, 0));  // [B, kv_heads, D]
        v_cache.index_put_({batch_rows, Slice(), cache->positions}, v.select(2, 0));
        k = k_cache.narrow(0, 0, batch).narrow(2, 0, cache->attend_len);  // [B, kv_heads, L, D]
        v = v_cache.narrow(0, 0, batch).narrow(2, 0, cache->attend_len);
        attn_mask = cache->attend_mask;
      }
    }
  }
  const bool causal = !attn_mask.has_value();
  // attn: [B, heads, T, D]; enable_gqa lets SDPA broadcast kv heads without materialising repeats.
  if (!attn.defined()) {
    attn = mask.packed() ? packed_causal_attention(q, k, v, mask, scale)
                         : at::scaled_dot_product_attention(q, k, v, attn_mask, 0.0, causal, scale,
                                                            /*enable_gqa=*/num_heads_ != num_kv_heads_);
  }
  at::Tensor merged = attn.transpose(1, 2).reshape({batch * seq, num_heads_ * head_dim_});
  if (gated_) merged = merged * at::sigmoid(gate);
  at::Tensor out = tp_.reduce_out(o_proj_.forward(merged, segments));  // [N, hidden]
  if (o_bias_.defined()) out = out + o_bias_;
  return out.view({batch, seq, -1});
}

void Attention::collect_lora(const std::string& prefix, std::vector<NamedLoraModule>& out) {
  const auto split = [&](dist::TpSplit s) { return tp_.enabled() ? s : dist::TpSplit::kReplicated; };
  out.push_back({prefix + ".q_proj", LoraGroup::kAttention, &q_proj_, split(dist::TpSplit::kColumn)});
  out.push_back({prefix + ".k_proj", LoraGroup::kAttention, &k_proj_, split(dist::TpSplit::kColumn)});
  out.push_back({prefix + ".v_proj", LoraGroup::kAttention, &v_proj_, split(dist::TpSplit::kColumn)});
  out.push_back({prefix + ".o_proj", LoraGroup::kAttention, &o_proj_, split(dist::TpSplit::kRow)});
}

void Attention::collect_parameters(const std::string& prefix, std::vector<NamedParameter>& out) const {
  for (const auto& [name, linear] : {std::pair{"q_proj", &q_proj_}, {"k_proj", &k_proj_}, {"v_proj", &v_proj_},
                                     {"o_proj", &o_proj_}}) {
    out.emplace_back(prefix + "." + name + ".weight", linear->weight());
    if (linear->bias().defined()) out.emplace_back(prefix + "." + name + ".bias", linear->bias());
  }
  if (o_bias_.defined()) out.emplace_back(prefix + ".o_proj.bias", o_bias_);
  if (!qk_norm_.empty()) {
    out.emplace_back(prefix + ".q_norm.weight", qk_norm_[0].weight());
    out.emplace_back(prefix + ".k_norm.weight", qk_norm_[1].weight());
  }
}

SwiGluMlp::SwiGluMlp(const ModelConfig& config, BuildContext& ctx, const std::string& prefix)
    : SwiGluMlp(config.hidden_size, config.intermediate_size, config.mlp_bias, ctx, prefix,
                /*tensor_parallel=*/true) {}

SwiGluMlp::SwiGluMlp(int64_t hidden, int64_t intermediate, bool bias, BuildContext& ctx, const std::string& prefix,
                     bool tensor_parallel)
    : tp_(tensor_parallel && ctx.tensor_parallel.enabled() ? &ctx.tensor_parallel : nullptr),
      gate_proj_(make_parallel_linear(ctx, prefix + ".gate_proj", intermediate, hidden, bias,
                                      tp_ ? dist::TpSplit::kColumn : dist::TpSplit::kReplicated)),
      up_proj_(make_parallel_linear(ctx, prefix + ".up_proj", intermediate, hidden, bias,
                                    tp_ ? dist::TpSplit::kColumn : dist::TpSplit::kReplicated)),
      down_proj_(make_parallel_linear(ctx, prefix + ".down_proj", hidden, intermediate, bias,
                                      tp_ ? dist::TpSplit::kRow : dist::TpSplit::kReplicated, &down_bias_)) {}

SwiGluMlp::SwiGluMlp(lora::LoraLinear gate, lora::LoraLinear up, lora::LoraLinear down, int owner, int rank,
                     int64_t hidden, int64_t intermediate)
    : tp_(nullptr),
      owner_(owner),
      held_by_(rank),
      hidden_(hidden),
      intermediate_(intermediate),
      gate_proj_(std::move(gate)),
      up_proj_(std::move(up)),
      down_proj_(std::move(down)) {}

std::unique_ptr<SwiGluMlp> SwiGluMlp::expert(int64_t hidden, int64_t intermediate, BuildContext& ctx,
                                             const std::string& prefix, int owner) {
  const dist::TensorParallel& tp = ctx.experts->group();
  auto linear = [&](const char* name, int64_t out, int64_t in) {
    at::Tensor w = ctx.weights.take_owned(prefix + "." + name + ".weight", {out, in}, owner, tp);  // or [0, 0]
    return lora::LoraLinear(std::move(w), at::Tensor(), ctx.num_slots, ctx.max_rank);
  };
  return std::unique_ptr<SwiGluMlp>(new SwiGluMlp(linear("gate_proj", intermediate, hidden),
                                                  linear("up_proj", intermediate, hidden),
                                                  linear("down_proj", hidden, intermediate), owner, tp.rank(),
                                                  hidden, intermediate));
}

at::Tensor SwiGluMlp::forward(const at::Tensor& x, const lora::AdapterSegments& segments) const {
  SKYRL_TX_INTERNAL_ASSERT(held(), "an expert another rank holds was run");
  if (tp_ == nullptr) {
    at::Tensor gated = ops::swiglu(gate_proj_.forward(x, segments), up_proj_.forward(x, segments));  // [N, inter]
    return down_proj_.forward(gated, segments);
  }
  at::Tensor in = tp_->copy_in(x);
  at::Tensor gated = ops::swiglu(gate_proj_.forward(in, segments), up_proj_.forward(in, segments));  // [N, inter/tp]
  at::Tensor out = tp_->reduce_out(down_proj_.forward(gated, segments));  // [N, hidden]
  return down_bias_.defined() ? out + down_bias_ : out;
}

void SwiGluMlp::collect_lora(const std::string& prefix, std::vector<NamedLoraModule>& out) {
  if (owner_ >= 0) {  // an expert one rank holds
    out.push_back({prefix + ".gate_proj", LoraGroup::kMlp, &gate_proj_, dist::TpSplit::kOwned, owner_,
                   intermediate_, hidden_});
    out.push_back({prefix + ".up_proj", LoraGroup::kMlp, &up_proj_, dist::TpSplit::kOwned, owner_,
                   intermediate_, hidden_});
    out.push_back({prefix + ".down_proj", LoraGroup::kMlp, &down_proj_, dist::TpSplit::kOwned, owner_, hidden_,
                   intermediate_});
    return;
  }
  const bool split = tp_ != nullptr;
  out.push_back({prefix + ".gate_proj", LoraGroup::kMlp, &gate_proj_,
                 split ? dist::TpSplit::kColumn : dist::TpSplit::kReplicated});
  out.push_back({prefix + ".up_proj", LoraGroup::kMlp, &up_proj_,
                 split ? dist::TpSplit::kColumn : dist::TpSplit::kReplicated});
  out.push_back({prefix + ".down_proj", LoraGroup::kMlp, &down_proj_,
                 split ? dist::TpSplit::kRow : dist::TpSplit::kReplicated});
}

void SwiGluMlp::collect_parameters(const std::string& prefix, std::vector<NamedParameter>& out) const {
  for (const auto& [name, linear] : {std::pair{"gate_proj", &gate_proj_}, {"up_proj", &up_proj_},
                                     {"down_proj", &down_proj_}}) {
    out.emplace_back(prefix + "." + name + ".weight", linear->weight());
    if (linear->bias().defined()) out.emplace_back(prefix + "." + name + ".bias", linear->bias());
  }
  if (down_bias_.defined()) out.emplace_back(prefix + ".down_proj.bias", down_bias_);
}

namespace {

const char* mixer_name(const ModelConfig& config, int64_t index) {
  return mixer_layout(config).at(index) == MixerKind::kGatedDeltaNet ? "linear_attn" : "self_attn";
}

std::unique_ptr<AttentionModule> make_mixer(const ModelConfig& config, BuildContext& ctx, const std::string& prefix,
                                            int64_t index) {
  if (mixer_layout(config).at(index) == MixerKind::kGatedDeltaNet) {
    return std::make_unique<GatedDeltaNet>(config, ctx, prefix);
  }
  switch (find_architecture(config.architecture).attention) {
    case AttentionKind::kGqa:
    case AttentionKind::kGatedGqa: return std::make_unique<Attention>(config, ctx, prefix);
    case AttentionKind::kMla: return std::make_unique<MlaAttention>(config, ctx, prefix);
  }
  throw Internal("unknown attention kind");
}

std::unique_ptr<MlpModule> make_mlp(const ModelConfig& config, BuildContext& ctx, const std::string& prefix,
                                    int64_t index) {
  switch (mlp_layout(config).at(index)) {
    case MlpKind::kDense: return std::make_unique<SwiGluMlp>(config, ctx, prefix);
    case MlpKind::kMoe: return std::make_unique<MoeMlp>(config, ctx, prefix);
  }
  throw Internal("unknown MLP kind");
}

}  // namespace

DecoderLayer::DecoderLayer(const ModelConfig& config, BuildContext& ctx, const std::string& prefix, int64_t index)
    : input_layernorm_(ctx.weights.take(prefix + ".input_layernorm.weight", {config.hidden_size}),
                       config.rms_norm_eps, find_architecture(config.architecture).zero_centered_norm),
      post_attention_layernorm_(ctx.weights.take(prefix + ".post_attention_layernorm.weight", {config.hidden_size}),
                                config.rms_norm_eps, find_architecture(config.architecture).zero_centered_norm),
      mixer_name_(mixer_name(config, index)),
      mixer_(make_mixer(config, ctx, prefix + "." + mixer_name_, index)),
      mlp_(make_mlp(config, ctx, prefix + ".mlp", index)) {}

at::Tensor DecoderLayer::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                 const AttentionMask& mask, const lora::AdapterSegments& segments,
                                 const KvCacheView* cache, int64_t layer) const {
  at::Tensor h = x + mixer_->forward(input_layernorm_.forward(x), cos, sin, mask, segments, cache, layer);
  at::Tensor normed = post_attention_layernorm_.forward(h);
  return h + mlp_->forward(normed.reshape({-1, normed.size(-1)}), segments).view_as(h);
}

void DecoderLayer::collect_lora(const std::string& prefix, std::vector<NamedLoraModule>& out) {
  mixer_->collect_lora(prefix + "." + mixer_name_, out);
  mlp_->collect_lora(prefix + ".mlp", out);
}

void DecoderLayer::collect_parameters(const std::string& prefix, std::vector<NamedParameter>& out) const {
  out.emplace_back(prefix + ".input_layernorm.weight", input_layernorm_.weight());
  mixer_->collect_parameters(prefix + "." + mixer_name_, out);
  out.emplace_back(prefix + ".post_attention_layernorm.weight", post_attention_layernorm_.weight());
  mlp_->collect_parameters(prefix + ".mlp", out);
}

}  // namespace skyrl_tx::models
