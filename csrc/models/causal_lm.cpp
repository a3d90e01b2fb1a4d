// CausalLM: the shared decoder stack (every registered architecture): embed → layers → final norm → lm_head (LoRA-capable).
#include "models/causal_lm.h"

#include <algorithm>

#include "common/errors.h"
#include "models/architectures.h"

namespace skyrl_tx::models {
namespace {

// Members built from the config (RoPE divides by head counts) must only ever see a validated one.
const ModelConfig& validated(const ModelConfig& config, const dist::TensorParallel& tp) {
  config.validate();
  if (!tp.enabled()) return config;
  const int64_t size = tp.size();
  const ArchitectureSpec& arch = find_architecture(config.architecture);
  // Mixture-of-experts layers run whole on every rank (experts, router and shared experts replicated: same input,
  // same output, same gradients); their attention, dense MLPs and vocabulary are split.
  SKYRL_TX_CHECK(!config.has_linear_attention() || (config.linear_num_key_heads % size == 0 &&
                                                    config.linear_num_value_heads % size == 0),
                 InvalidArgument, "tensor_parallel_size ", size, " must divide the linear-attention key heads (",
                 config.linear_num_key_heads, ") and value heads (", config.linear_num_value_heads,
                 "); choose a divisor of ", config.linear_num_key_heads);
  const std::vector<MlpKind> mlps = mlp_layout(config);
  const bool dense_mlps = std::find(mlps.begin(), mlps.end(), MlpKind::kDense) != mlps.end();
  const bool mla = arch.attention == AttentionKind::kMla;  // its one latent is whole on every rank: no KV heads
  SKYRL_TX_CHECK(config.num_attention_heads % size == 0 && (mla || config.num_key_value_heads % size == 0) &&
                     (!dense_mlps || config.intermediate_size % size == 0),
                 InvalidArgument, "tensor_parallel_size ", size, " must divide the model's attention heads (",
                 config.num_attention_heads, "), KV heads (", config.num_key_value_heads,
                 ") and MLP width (", config.intermediate_size, "); choose a divisor of ",
                 config.num_key_value_heads);
  SKYRL_TX_CHECK(tp.shard_of(config.vocab_size, static_cast<int>(size) - 1).length > 0, InvalidArgument,
                 "tensor_parallel_size ", size, " leaves a rank no vocabulary rows (vocab_size ", config.vocab_size,
                 ")");
  return config;
}

}  // namespace

CausalLM::CausalLM(const ModelConfig& config, WeightMap weights, const ModelOptions& options)
    : config_(validated(config, options.tensor_parallel)),
      options_(options),
      vocab_shard_(options.tensor_parallel.shard(config.vocab_size)),
      rope_(config_, options.device) {
  WeightStore store(std::move(weights), options.dtype, options.device, options.weights_are_parts,
                    options.adopt_weights);
  const dist::TensorParallel& tp = options_.tensor_parallel;
  if (options.split_experts && options.experts_over_data_parallel) {
    expert_parallel_ = dist::ExpertParallel(dist::TensorParallel(options.experts_over_data_parallel), true);
  } else if (options.split_experts) {
    expert_parallel_ = dist::ExpertParallel(tp, false);
  }
  BuildContext ctx{store, options.num_slots, options.max_rank, tp, &expert_parallel_, options.grouped_expert_gemm};
  // Vocabulary-parallel: rows [vocab_shard_.begin, + length) of the embedding and of the lm_head.
  embed_tokens_ = store.take_part("model.embed_tokens.weight", {config.vocab_size, config.hidden_size}, 0, tp);
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    layers_.push_back(std::make_unique<DecoderLayer>(config, ctx, str_cat("model.layers.", i), i));
  }
  norm_ = std::make_unique<RmsNorm>(store.take("model.norm.weight", {config.hidden_size}), config.rms_norm_eps,
                                    find_architecture(config.architecture).zero_centered_norm);
  at::Tensor head;
  if (config.tie_word_embeddings) {
    // Tied checkpoints usually omit lm_head.weight; some repeat it. Either way tied means "use the embedding".
    store.take_optional("lm_head.weight", {config.vocab_size, config.hidden_size});
    head = embed_tokens_;
  } else {
    head = store.take_part("lm_head.weight", {config.vocab_size, config.hidden_size}, 0, tp);
  }
  lm_head_ = std::make_unique<lora::LoraLinear>(head, at::Tensor(), options.num_slots, options.max_rank);
  store.finish();
  parameter_splits_ = store.splits();

  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    layers_[i]->collect_lora(str_cat("model.layers.", i), lora_modules_);
  }
  lora_modules_.push_back({"lm_head", LoraGroup::kUnembed, lm_head_.get(),
                           tp.enabled() ? dist::TpSplit::kColumn : dist::TpSplit::kReplicated});
  const std::vector<MlpKind> layout = mlp_layout(config_);
  // Gated DeltaNet decode updates recurrent state rows the static decoder does not manage: eager too.
  // Tensor parallel: a decode step runs collectives, which a captured graph would not replay with the group.
  cuda_graph_capturable_ = std::find(layout.begin(), layout.end(), MlpKind::kMoe) == layout.end() &&
                           !config_.has_linear_attention() && !tp.enabled();
}

at::Tensor CausalLM::hidden_states(const at::Tensor& input_ids, const at::Tensor& positions,
                                   const AttentionMask& mask, const lora::AdapterSegments& segments,
                                   const KvCacheView* cache) const {
  SKYRL_TX_INTERNAL_ASSERT(segments.num_tokens() == input_ids.numel(), "segments must cover the batch");
  at::Tensor h = embed(input_ids);                               // [B, T, hidden]
  auto [cos, sin] = rope(positions, h.scalar_type());           // [B, T, head_dim]
  for (int64_t i = 0; i < num_layers(); ++i) h = layer_forward(i, h, cos, sin, mask, segments, cache);
  return final_norm(h);
}

at::Tensor CausalLM::embed(const at::Tensor& input_ids) const {
  const dist::TensorParallel& tp = options_.tensor_parallel;
  if (!tp.enabled()) return at::embedding(embed_tokens_, input_ids);
  // Each rank looks up the ids it holds (zeros for the others); the sum over ranks is every id's row.
  const at::Tensor local = input_ids - vocab_shard_.begin;  // [B, T]
  const at::Tensor here = (local >= 0).logical_and(local < vocab_shard_.length).unsqueeze(-1);  // [B, T, 1]
  at::Tensor rows = at::embedding(embed_tokens_, local.clamp(0, vocab_shard_.length - 1));  // [B, T, hidden]
  return tp.reduce_out(rows * here.to(rows.scalar_type()));
}

at::Tensor CausalLM::logits(const at::Tensor& hidden, const lora::AdapterSegments& segments) const {
  at::Tensor local = lm_head_->forward(hidden, segments);  // [N, vocab shard]
  return options_.tensor_parallel.gather(local, 1, config_.vocab_size);  // [N, vocab]
}

std::pair<at::Tensor, at::Tensor> CausalLM::rope(const at::Tensor& positions, at::ScalarType dtype) const {
  return rope_.cos_sin(positions, dtype);
}

at::Tensor CausalLM::layer_forward(int64_t layer, const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin,
                                   const AttentionMask& mask, const lora::AdapterSegments& segments,
                                   const KvCacheView* cache) const {
  return layers_.at(layer)->forward(h, cos, sin, mask, segments, cache, layer);
}

at::Tensor CausalLM::final_norm(const at::Tensor& h) const {
  at::Tensor normed = norm_->forward(h);
  return normed.reshape({-1, normed.size(-1)});
}

dist::TensorSplit CausalLM::parameter_split(const std::string& name) const {
  auto it = parameter_splits_.find(name);
  return it == parameter_splits_.end() ? dist::TensorSplit{} : it->second;
}

bool CausalLM::partial_gradient(const std::string& name) const {
  if (!options_.tensor_parallel.enabled()) return false;
  const auto ends_with = [&](const char* suffix) {
    const std::string s(suffix);
    return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
  };
  // The router's weights get only this rank's experts' share when the experts are split. MLA's low-rank q_a /
  // kv_a projections and norms feed every head, and each rank's heads give their share.
  for (const char* suffix : {".self_attn.q_norm.weight", ".self_attn.k_norm.weight", ".self_attn.q_a_proj.weight",
                             ".self_attn.q_a_proj.bias", ".self_attn.q_a_layernorm.weight",
                             ".self_attn.kv_a_proj_with_mqa.weight", ".self_attn.kv_a_proj_with_mqa.bias",
                             ".self_attn.kv_a_layernorm.weight", ".linear_attn.norm.weight"}) {
    if (ends_with(suffix)) return true;
  }
  return options_.split_experts && !options_.experts_over_data_parallel && ends_with(".mlp.gate.weight");
}

std::vector<NamedParameter> CausalLM::named_parameters() const {
  std::vector<NamedParameter> out;
  out.emplace_back("model.embed_tokens.weight", embed_tokens_);
  for (int64_t i = 0; i < num_layers(); ++i) layers_[i]->collect_parameters(str_cat("model.layers.", i), out);
  out.emplace_back("model.norm.weight", norm_->weight());
  if (!config_.tie_word_embeddings) out.emplace_back("lm_head.weight", lm_head_->weight());
  return out;
}

}  // namespace skyrl_tx::models
