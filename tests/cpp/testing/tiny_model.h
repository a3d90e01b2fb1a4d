// Shared test helpers: tiny Qwen3 / Llama configs, random HF-named weights, and a plain-ATen reference decoder.
#pragma once

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "models/hf_weights.h"
#include "models/model_config.h"

namespace skyrl_tx::testing {

inline at::Generator make_gen(uint64_t seed) { return at::make_generator<at::CPUGeneratorImpl>(seed); }

inline at::Tensor randn(at::IntArrayRef shape, at::Generator& gen, double scale = 1.0) {
  return at::randn(shape, gen, at::TensorOptions().dtype(at::kFloat)) * scale;
}

/// Qwen3-style: qk_norm, untied lm_head, default RoPE.
inline models::ModelConfig tiny_qwen3_config() {
  models::ModelConfig c;
  c.architecture = "Qwen3ForCausalLM";
  c.vocab_size = 50;
  c.hidden_size = 32;
  c.intermediate_size = 64;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  c.rope_theta = 10000.0;
  c.rms_norm_eps = 1e-6;
  c.qk_norm = true;
  return c;
}

/// Llama 3.1-style: tied embeddings and llama3 RoPE scaling (head_dim 8 puts one frequency in each band).
inline models::ModelConfig tiny_llama_config() {
  models::ModelConfig c = tiny_qwen3_config();
  c.architecture = "LlamaForCausalLM";
  c.qk_norm = false;
  c.tie_word_embeddings = true;
  c.rope_theta = 500000.0;
  c.rms_norm_eps = 1e-5;
  c.rope_scaling.type = "llama3";
  c.rope_scaling.factor = 8.0;
  c.rope_scaling.low_freq_factor = 1.0;
  c.rope_scaling.high_freq_factor = 4.0;
  c.rope_scaling.original_max_position_embeddings = 8192;
  return c;
}

/// Norm weights near 1 so normalisation still matters.
inline at::Tensor norm_weight(int64_t dim, at::Generator& gen) { return 1.0 + randn({dim}, gen, 0.1); }

/// Adds "<prefix>.{q,k,v,o}_proj.weight" (+ q_norm/k_norm when qk_norm) for an attention block.
inline void add_attention_weights(models::WeightMap& w, const models::ModelConfig& c, const std::string& prefix,
                                  at::Generator& gen) {
  const int64_t d = c.resolved_head_dim(), h = c.hidden_size;
  const double s = 1.0 / std::sqrt(static_cast<double>(h));
  w[prefix + ".q_proj.weight"] = randn({c.num_attention_heads * d, h}, gen, s);
  w[prefix + ".k_proj.weight"] = randn({c.num_key_value_heads * d, h}, gen, s);
  w[prefix + ".v_proj.weight"] = randn({c.num_key_value_heads * d, h}, gen, s);
  w[prefix + ".o_proj.weight"] = randn({h, c.num_attention_heads * d}, gen, s);
  if (c.qk_norm) {
    w[prefix + ".q_norm.weight"] = norm_weight(d, gen);
    w[prefix + ".k_norm.weight"] = norm_weight(d, gen);
  }
}

/// Adds "<prefix>.{gate,up,down}_proj.weight" for a SwiGLU MLP.
inline void add_mlp_weights(models::WeightMap& w, const models::ModelConfig& c, const std::string& prefix,
                            at::Generator& gen) {
  const int64_t h = c.hidden_size, i = c.intermediate_size;
  w[prefix + ".gate_proj.weight"] = randn({i, h}, gen, 1.0 / std::sqrt(static_cast<double>(h)));
  w[prefix + ".up_proj.weight"] = randn({i, h}, gen, 1.0 / std::sqrt(static_cast<double>(h)));
  w[prefix + ".down_proj.weight"] = randn({h, i}, gen, 1.0 / std::sqrt(static_cast<double>(i)));
}

inline void add_layer_weights(models::WeightMap& w, const models::ModelConfig& c, const std::string& prefix,
                              at::Generator& gen) {
  w[prefix + ".input_layernorm.weight"] = norm_weight(c.hidden_size, gen);
  w[prefix + ".post_attention_layernorm.weight"] = norm_weight(c.hidden_size, gen);
  add_attention_weights(w, c, prefix + ".self_attn", gen);
  add_mlp_weights(w, c, prefix + ".mlp", gen);
}

/// Every tensor of a full checkpoint, HF-named; lm_head.weight only when not tied.
inline models::WeightMap random_weights(const models::ModelConfig& c, uint64_t seed) {
  at::Generator gen = make_gen(seed);
  models::WeightMap w;
  w["model.embed_tokens.weight"] = randn({c.vocab_size, c.hidden_size}, gen);
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) add_layer_weights(w, c, "model.layers." + std::to_string(i), gen);
  w["model.norm.weight"] = norm_weight(c.hidden_size, gen);
  if (!c.tie_word_embeddings) w["lm_head.weight"] = randn({c.vocab_size, c.hidden_size}, gen, 0.3);
  return w;
}

/// A shallow copy (tensors shared) to hand to constructors that consume a WeightMap.
inline models::WeightMap copy_of(const models::WeightMap& w) { return w; }

/// inv_freq[i] = 1 / theta^(2i/d), then Llama 3.1 band scaling, element by element in double.
inline at::Tensor reference_inv_freq(const models::ModelConfig& c) {
  const int64_t d = c.resolved_head_dim();
  std::vector<double> out;
  for (int64_t i = 0; i < d / 2; ++i) {
    double f = 1.0 / std::pow(c.rope_theta, 2.0 * static_cast<double>(i) / static_cast<double>(d));
    if (c.rope_scaling.type == "llama3") {
      const auto& s = c.rope_scaling;
      const double old_len = static_cast<double>(s.original_max_position_embeddings);
      const double wavelen = 2 * M_PI / f;
      if (wavelen > old_len / s.low_freq_factor) {
        f = f / s.factor;  // low frequency: fully interpolated
      } else if (wavelen >= old_len / s.high_freq_factor) {
        const double smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
        f = (1 - smooth) * f / s.factor + smooth * f;
      }  // high frequency: unchanged
    }
    out.push_back(f);
  }
  return at::tensor(out, at::kDouble).to(at::kFloat);
}

/// Plain-ATen reference of the decoder, one unpadded sequence at a time. Optional LoRA factors under
/// PEFT names ("<module>.lora_A.weight" / ".lora_B.weight") with one scaling.
struct ReferenceModel {
  models::ModelConfig config;
  models::WeightMap weights;
  std::map<std::string, at::Tensor> lora;
  double scaling = 0.0;

  const at::Tensor& w(const std::string& name) const { return weights.at(name); }

  /// x W^T + scaling * (x A^T) B^T for module `name` (the LoRA term only if its factors are given).
  at::Tensor linear(const at::Tensor& x, const std::string& name) const {
    at::Tensor y = at::matmul(x, w(name + ".weight").t());
    auto a = lora.find(name + ".lora_A.weight");
    if (a != lora.end()) y = y + scaling * at::matmul(at::matmul(x, a->second.t()), lora.at(name + ".lora_B.weight").t());
    return y;
  }

  at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight) const {
    return weight * x / at::sqrt(x.pow(2).mean(-1, true) + config.rms_norm_eps);
  }

  /// x: [heads, T, D]; rotates each pair (x_i, x_{i + D/2}) by angle t * inv_freq[i].
  at::Tensor rope(const at::Tensor& x) const {
    const int64_t t = x.size(1), half = x.size(2) / 2;
    at::Tensor angle = at::arange(t, at::kFloat).unsqueeze(1) * reference_inv_freq(config).unsqueeze(0);  // [T, D/2]
    at::Tensor c = angle.cos(), s = angle.sin();
    at::Tensor x1 = x.narrow(-1, 0, half), x2 = x.narrow(-1, half, half);
    return at::cat({x1 * c - x2 * s, x2 * c + x1 * s}, -1);
  }

  /// x: [T, hidden] → [T, hidden]: causal softmax attention, kv heads repeated for GQA.
  at::Tensor attention(const at::Tensor& x, const std::string& prefix) const {
    const int64_t t = x.size(0), d = config.resolved_head_dim();
    const int64_t nh = config.num_attention_heads, nkv = config.num_key_value_heads;
    at::Tensor q = linear(x, prefix + ".q_proj").view({t, nh, d});
    at::Tensor k = linear(x, prefix + ".k_proj").view({t, nkv, d});
    at::Tensor v = linear(x, prefix + ".v_proj").view({t, nkv, d});
    if (config.qk_norm) {
      q = rms_norm(q, w(prefix + ".q_norm.weight"));
      k = rms_norm(k, w(prefix + ".k_norm.weight"));
    }
    q = rope(q.transpose(0, 1));                                                        // [nh, T, D]
    k = rope(k.transpose(0, 1)).repeat_interleave(nh / nkv, 0);                         // [nh, T, D]
    v = v.transpose(0, 1).repeat_interleave(nh / nkv, 0);                               // [nh, T, D]
    at::Tensor scores = at::matmul(q, k.transpose(1, 2)) / std::sqrt(static_cast<double>(d));  // [nh, T, T]
    at::Tensor future = at::ones({t, t}, at::kBool).triu(1);
    scores = scores.masked_fill(future, -std::numeric_limits<float>::infinity());
    at::Tensor out = at::matmul(at::softmax(scores, -1), v);  // [nh, T, D]
    return linear(out.transpose(0, 1).reshape({t, nh * d}), prefix + ".o_proj");
  }

  at::Tensor mlp(const at::Tensor& x, const std::string& prefix) const {
    return linear(at::silu(linear(x, prefix + ".gate_proj")) * linear(x, prefix + ".up_proj"), prefix + ".down_proj");
  }

  at::Tensor layer(const at::Tensor& x, const std::string& prefix) const {
    at::Tensor h = x + attention(rms_norm(x, w(prefix + ".input_layernorm.weight")), prefix + ".self_attn");
    return h + mlp(rms_norm(h, w(prefix + ".post_attention_layernorm.weight")), prefix + ".mlp");
  }

  /// ids: int64 [T] → final-norm hidden states [T, hidden].
  at::Tensor hidden(const at::Tensor& ids) const {
    at::Tensor h = w("model.embed_tokens.weight").index_select(0, ids);
    for (int64_t i = 0; i < config.num_hidden_layers; ++i) h = layer(h, "model.layers." + std::to_string(i));
    return rms_norm(h, w("model.norm.weight"));
  }

  /// log p(targets[i] | ids[0..i]) → float32 [T].
  at::Tensor logprobs(const at::Tensor& ids, const at::Tensor& targets) const {
    at::Tensor h = hidden(ids);
    at::Tensor head = config.tie_word_embeddings ? w("model.embed_tokens.weight") : w("lm_head.weight");
    at::Tensor logits = at::matmul(h, head.t());
    auto a = lora.find("lm_head.lora_A.weight");
    if (a != lora.end()) logits = logits + scaling * at::matmul(at::matmul(h, a->second.t()), lora.at("lm_head.lora_B.weight").t());
    return at::log_softmax(logits, -1).gather(1, targets.unsqueeze(1)).squeeze(1);
  }
};

/// Random int64 token ids in [0, vocab).
inline at::Tensor random_tokens(int64_t length, int64_t vocab, at::Generator& gen) {
  return at::randint(vocab, {length}, gen, at::TensorOptions().dtype(at::kLong));
}

}  // namespace skyrl_tx::testing
