// CausalLM: the shared decoder stack (every registered architecture): embed → layers → final norm → lm_head (LoRA-capable).
#include "models/causal_lm.h"

#include <algorithm>

#include "common/errors.h"
#include "models/architectures.h"

namespace skyrl_tx::models {
namespace {

// Members built from the config (RoPE divides by head counts) must only ever see a validated one.
const ModelConfig& validated(const ModelConfig& config) {
  config.validate();
  return config;
}

}  // namespace

CausalLM::CausalLM(const ModelConfig& config, WeightMap weights, const ModelOptions& options)
    : config_(validated(config)), options_(options), rope_(config_, options.device) {
  WeightStore store(std::move(weights), options.dtype, options.device);
  BuildContext ctx{store, options.num_slots, options.max_rank};
  embed_tokens_ = store.take("model.embed_tokens.weight", {config.vocab_size, config.hidden_size});
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    layers_.push_back(std::make_unique<DecoderLayer>(config, ctx, str_cat("model.layers.", i), i));
  }
  norm_ = std::make_unique<RmsNorm>(store.take("model.norm.weight", {config.hidden_size}), config.rms_norm_eps,
                                    find_architecture(config.architecture).zero_centered_norm);
  at::Tensor head = config.tie_word_embeddings
                        ? store.take_optional("lm_head.weight", {config.vocab_size, config.hidden_size})
                        : store.take("lm_head.weight", {config.vocab_size, config.hidden_size});
  // Tied checkpoints usually omit lm_head.weight; some repeat it. Either way tied means "use the embedding".
  if (config.tie_word_embeddings) head = embed_tokens_;
  lm_head_ = std::make_unique<lora::LoraLinear>(head, at::Tensor(), options.num_slots, options.max_rank);
  store.finish();

  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    layers_[i]->collect_lora(str_cat("model.layers.", i), lora_modules_);
  }
  lora_modules_.push_back({"lm_head", LoraGroup::kUnembed, lm_head_.get()});
  const std::vector<MlpKind> layout = mlp_layout(config_);
  // Gated DeltaNet decode updates recurrent state rows the static decoder does not manage: eager too.
  cuda_graph_capturable_ = std::find(layout.begin(), layout.end(), MlpKind::kMoe) == layout.end() &&
                           !config_.has_linear_attention();
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

at::Tensor CausalLM::embed(const at::Tensor& input_ids) const { return at::embedding(embed_tokens_, input_ids); }

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

std::vector<NamedParameter> CausalLM::named_parameters() const {
  std::vector<NamedParameter> out;
  out.emplace_back("model.embed_tokens.weight", embed_tokens_);
  for (int64_t i = 0; i < num_layers(); ++i) layers_[i]->collect_parameters(str_cat("model.layers.", i), out);
  out.emplace_back("model.norm.weight", norm_->weight());
  if (!config_.tie_word_embeddings) out.emplace_back("lm_head.weight", lm_head_->weight());
  return out;
}

}  // namespace skyrl_tx::models
