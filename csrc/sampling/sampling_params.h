// SamplingParams and sample requests/results: what one Tinker sample call asks for and gets back.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace skyrl_tx::sampling {

/// The SDK's SamplingParams. temperature 0 = greedy; top_k <= 0 = off; top_p 1 = off.
struct SamplingParams {
  int64_t max_tokens = 16;
  double temperature = 1.0;
  int64_t top_k = -1;
  double top_p = 1.0;
  std::optional<uint64_t> seed;             // unset: drawn from the backend's generator
  std::vector<int64_t> stop_tokens;         // in addition to the model's EOS tokens
  std::vector<std::string> stop_strings;    // matched on the decoded bytes of the completion
  bool stop_at_eos = true;                  // false: run to max_tokens unless a stop token/string hits

  /// Throws InvalidArgument naming the field (max_tokens < 1, temperature < 0, top_p outside (0, 1], ...).
  void validate(int64_t vocab_size) const;
};

struct SampleRequest {
  std::string weights_id;   // "" = base model, a live adapter id, or a snapshot id
  at::Tensor prompt;        // [P] int64, P >= 1
  int64_t num_samples = 1;
  SamplingParams params;
  bool prompt_logprobs = false;   // logprob of every prompt token (first entry: none)
  int64_t topk_prompt_logprobs = 0;  // also the k most likely tokens at every prompt position
};

struct SampledSequence {
  std::vector<int64_t> tokens;
  std::vector<float> logprobs;  // of each sampled token under the unmodified model distribution
  std::string stop_reason;      // "stop" (EOS, stop token or stop string) or "length"
};

struct SampleResult {
  std::vector<SampledSequence> sequences;  // num_samples of them
  // [P] float32 when asked; entry 0 is NaN (no logprob for the first prompt token).
  at::Tensor prompt_logprobs;
  // [P, k] when asked: token ids and logprobs of the k most likely tokens, sorted descending; row 0 unused.
  at::Tensor topk_prompt_token_ids;
  at::Tensor topk_prompt_logprobs;
};

}  // namespace skyrl_tx::sampling
