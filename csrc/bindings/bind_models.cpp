// Binds the plain config structs (ModelConfig, RopeScaling, LoraConfig, BackendConfig) and the architecture registry.
#include <pybind11/stl.h>

#include "backend/backend_config.h"
#include "bindings/bindings.h"
#include "lora/lora_config.h"
#include "models/architectures.h"
#include "models/model_config.h"

namespace py = pybind11;

namespace skyrl_tx::bindings {

void bind_models(py::module_& m) {
  using models::ModelConfig;
  using models::RopeScaling;
  py::class_<RopeScaling>(m, "RopeScaling")
      .def(py::init<>())
      .def_readwrite("type", &RopeScaling::type)
      .def_readwrite("factor", &RopeScaling::factor)
      .def_readwrite("low_freq_factor", &RopeScaling::low_freq_factor)
      .def_readwrite("high_freq_factor", &RopeScaling::high_freq_factor)
      .def_readwrite("original_max_position_embeddings", &RopeScaling::original_max_position_embeddings)
      .def_readwrite("beta_fast", &RopeScaling::beta_fast)
      .def_readwrite("beta_slow", &RopeScaling::beta_slow)
      .def_readwrite("mscale", &RopeScaling::mscale)
      .def_readwrite("mscale_all_dim", &RopeScaling::mscale_all_dim)
      .def_readwrite("attention_factor", &RopeScaling::attention_factor);
  py::class_<ModelConfig>(m, "ModelConfig")
      .def(py::init<>())
      .def_readwrite("architecture", &ModelConfig::architecture)
      .def_readwrite("vocab_size", &ModelConfig::vocab_size)
      .def_readwrite("hidden_size", &ModelConfig::hidden_size)
      .def_readwrite("intermediate_size", &ModelConfig::intermediate_size)
      .def_readwrite("num_hidden_layers", &ModelConfig::num_hidden_layers)
      .def_readwrite("num_attention_heads", &ModelConfig::num_attention_heads)
      .def_readwrite("num_key_value_heads", &ModelConfig::num_key_value_heads)
      .def_readwrite("head_dim", &ModelConfig::head_dim)
      .def_readwrite("max_position_embeddings", &ModelConfig::max_position_embeddings)
      .def_readwrite("rope_theta", &ModelConfig::rope_theta)
      .def_readwrite("rms_norm_eps", &ModelConfig::rms_norm_eps)
      .def_readwrite("qk_norm", &ModelConfig::qk_norm)
      .def_readwrite("tie_word_embeddings", &ModelConfig::tie_word_embeddings)
      .def_readwrite("attention_bias", &ModelConfig::attention_bias)
      .def_readwrite("mlp_bias", &ModelConfig::mlp_bias)
      .def_readwrite("rope_scaling", &ModelConfig::rope_scaling)
      .def_readwrite("num_experts", &ModelConfig::num_experts)
      .def_readwrite("num_experts_per_tok", &ModelConfig::num_experts_per_tok)
      .def_readwrite("moe_intermediate_size", &ModelConfig::moe_intermediate_size)
      .def_readwrite("norm_topk_prob", &ModelConfig::norm_topk_prob)
      .def_readwrite("decoder_sparse_step", &ModelConfig::decoder_sparse_step)
      .def_readwrite("mlp_only_layers", &ModelConfig::mlp_only_layers)
      .def_readwrite("first_k_dense_replace", &ModelConfig::first_k_dense_replace)
      .def_readwrite("n_shared_experts", &ModelConfig::n_shared_experts)
      .def_readwrite("shared_expert_intermediate_size", &ModelConfig::shared_expert_intermediate_size)
      .def_readwrite("scoring_func", &ModelConfig::scoring_func)
      .def_readwrite("n_group", &ModelConfig::n_group)
      .def_readwrite("topk_group", &ModelConfig::topk_group)
      .def_readwrite("routed_scaling_factor", &ModelConfig::routed_scaling_factor)
      .def_readwrite("q_lora_rank", &ModelConfig::q_lora_rank)
      .def_readwrite("kv_lora_rank", &ModelConfig::kv_lora_rank)
      .def_readwrite("qk_nope_head_dim", &ModelConfig::qk_nope_head_dim)
      .def_readwrite("qk_rope_head_dim", &ModelConfig::qk_rope_head_dim)
      .def_readwrite("v_head_dim", &ModelConfig::v_head_dim)
      .def_readwrite("rope_interleave", &ModelConfig::rope_interleave)
      .def_readwrite("partial_rotary_factor", &ModelConfig::partial_rotary_factor)
      .def_readwrite("layer_types", &ModelConfig::layer_types)
      .def_readwrite("linear_num_key_heads", &ModelConfig::linear_num_key_heads)
      .def_readwrite("linear_num_value_heads", &ModelConfig::linear_num_value_heads)
      .def_readwrite("linear_key_head_dim", &ModelConfig::linear_key_head_dim)
      .def_readwrite("linear_value_head_dim", &ModelConfig::linear_value_head_dim)
      .def_readwrite("linear_conv_kernel_dim", &ModelConfig::linear_conv_kernel_dim)
      .def("validate", &ModelConfig::validate)
      .def(
          "mlp_layout",
          [](const ModelConfig& c) {
            std::vector<std::string> kinds;
            for (models::MlpKind k : models::mlp_layout(c)) kinds.emplace_back(models::mlp_kind_name(k));
            return kinds;
          },
          "One MLP kind per layer ('dense' or 'moe'), from the registry's layout rule.")
      .def(
          "mixer_layout",
          [](const ModelConfig& c) {
            std::vector<std::string> kinds;
            for (models::MixerKind k : models::mixer_layout(c)) kinds.emplace_back(models::mixer_kind_name(k));
            return kinds;
          },
          "One token-mixer kind per layer ('attention' or 'gated_deltanet'), from layer_types.");
  m.def(
      "supported_architectures",
      [] {
        std::vector<py::dict> out;
        for (const models::ArchitectureSpec& spec : models::architectures()) {
          py::dict d;
          d["model_type"] = spec.model_type;
          d["architecture"] = spec.architecture;
          d["attention"] = models::attention_kind_name(spec.attention);
          d["layout"] = models::layout_rule_name(spec.layout);
          d["qk_norm"] = spec.qk_norm;
          d["zero_centered_norm"] = spec.zero_centered_norm;
          out.push_back(std::move(d));
        }
        return out;
      },
      "The C++ architecture registry (models/architectures.h), for the Python table's agreement test.");

  using lora::LoraConfig;
  py::class_<LoraConfig>(m, "LoraConfig")
      .def(py::init<>())
      .def_readwrite("rank", &LoraConfig::rank)
      .def_readwrite("alpha", &LoraConfig::alpha)
      .def_readwrite("seed", &LoraConfig::seed)
      .def_readwrite("train_attn", &LoraConfig::train_attn)
      .def_readwrite("train_mlp", &LoraConfig::train_mlp)
      .def_readwrite("train_unembed", &LoraConfig::train_unembed);

  using backend::BackendConfig;
  py::class_<BackendConfig>(m, "BackendConfig")
      .def(py::init<>())
      .def_readwrite("max_lora_adapters", &BackendConfig::max_lora_adapters)
      .def_readwrite("max_lora_rank", &BackendConfig::max_lora_rank)
      .def_readwrite("dtype", &BackendConfig::dtype)
      .def_readwrite("device", &BackendConfig::device)
      .def_readwrite("logprobs_chunk_tokens", &BackendConfig::logprobs_chunk_tokens)
      .def_readwrite("max_logprobs_k", &BackendConfig::max_logprobs_k)
      .def_readwrite("prefix_caching", &BackendConfig::prefix_caching)
      .def_readwrite("sample_packed_prefill", &BackendConfig::sample_packed_prefill)
      .def_readwrite("seed", &BackendConfig::seed)
      .def_readwrite("max_full_models", &BackendConfig::max_full_models)
      .def_readwrite("train_micro_batch_tokens", &BackendConfig::train_micro_batch_tokens)
      .def_readwrite("train_micro_batch_size", &BackendConfig::train_micro_batch_size)
      .def_readwrite("expert_parallel_size", &BackendConfig::expert_parallel_size)
      .def_readwrite("grouped_expert_gemm", &BackendConfig::grouped_expert_gemm)
      .def_readwrite("gradient_checkpointing", &BackendConfig::gradient_checkpointing)
      .def_readwrite("train_packed_sequences", &BackendConfig::train_packed_sequences)
      .def_readwrite("max_sampling_sequences", &BackendConfig::max_sampling_sequences)
      .def_readwrite("max_sampling_length", &BackendConfig::max_sampling_length)
      .def_readwrite("gpu_memory_utilization", &BackendConfig::gpu_memory_utilization)
      .def_readwrite("max_resident_snapshots", &BackendConfig::max_resident_snapshots)
      .def_readwrite("cuda_graphs", &BackendConfig::cuda_graphs)
      .def_readwrite("zero_bucket_mb", &BackendConfig::zero_bucket_mb)
      .def("validate", &BackendConfig::validate);
}

}  // namespace skyrl_tx::bindings
