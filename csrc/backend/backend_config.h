// BackendConfig: server-wide limits and compute settings for one base model (from --backend-config).
#pragma once

#include <cstdint>
#include <string>

namespace skyrl_tx::backend {

struct BackendConfig {
  int64_t max_lora_adapters = 8;       // live adapters (slots 1..N); slot 0 is the base model
  int64_t max_lora_rank = 32;
  std::string dtype = "float32";       // compute dtype: "float32" or "bfloat16"
  std::string device = "cpu";          // "cpu", "cuda", "cuda:N"
  int64_t logprobs_chunk_tokens = 1024;  // rows of [tokens, vocab] logits materialised at once
  uint64_t seed = 0;

  /// Throws InvalidArgument naming the field.
  void validate() const;
};

}  // namespace skyrl_tx::backend
