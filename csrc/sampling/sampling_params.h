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
  int64_t prompt_logprobs_last_n = 0;  // > 0: the two above only for the last N prompt tokens; 0: all of them
  // [P - 1, K] int64 when asked: row i names token ids scored at prompt position i + 1; -1 asks nothing.
  at::Tensor target_prompt_token_ids;
  int64_t prompt_alt_tokens_k = 0;   // k draws at the request's temperature at every prompt position after 0
  int64_t topk_sample_logprobs = 0;  // the k most likely tokens at every generated position
};

struct SampledSequence {
  std::vector<int64_t> tokens;
  std::vector<float> logprobs;  // of each sampled token under the unmodified model distribution
  std::string stop_reason;      // "stop" (EOS, stop token or stop string) or "length"
  // [tokens * k] row-major when topk_sample_logprobs = k > 0: the k most likely ids (descending) at each step.
  std::vector<int64_t> topk_token_ids;
  std::vector<float> topk_logprobs;
};

struct SampleResult {
  std::vector<SampledSequence> sequences;  // num_samples of them
  // [P] float32 when asked; entry 0 is NaN (no logprob for the first prompt token).
  at::Tensor prompt_logprobs;  // with prompt_logprobs_last_n = N, entries before P - N are NaN as well
  // [P, k] when asked: token ids and logprobs of the k most likely tokens, sorted descending; row 0 unused.
  at::Tensor topk_prompt_token_ids;
  at::Tensor topk_prompt_logprobs;
  // [P - 1, K] float32 when target ids were asked: the logprob of each named id, 0 where it was -1.
  at::Tensor target_prompt_logprobs;
  // [P - 1, k] when prompt_alt_tokens_k = k > 0: row i holds k draws for prompt token i + 1 and their logprobs
  // under the unmodified model distribution.
  at::Tensor prompt_alt_token_ids;
  at::Tensor prompt_alt_logprobs;
  int64_t prompt_cache_hit_tokens = 0;  // prompt tokens whose K/V came from the prefix cache (not prefilled)
};

}  // namespace skyrl_tx::sampling
