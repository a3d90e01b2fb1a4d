// Generator: continuous batching over a KV cache: queued requests are prefilled into free rows and join
// the running decode batch; finished sequences leave it, so one long request never holds the others back.
#pragma once

#include <ATen/ATen.h>

#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "models/causal_lm.h"
#include "sampling/kv_cache.h"
#include "sampling/prefix_cache.h"
#include "sampling/sampling_params.h"
#include "sampling/static_decoder.h"
#include "sampling/stop_matcher.h"

namespace skyrl_tx::sampling {

struct GeneratorConfig {
  int64_t max_sequences = 16;           // KV cache rows (sequences decoding at once)
  int64_t max_length = 2048;            // prompt + completion tokens per sequence
  int64_t prefill_token_budget = 8192;  // prompt tokens prefilled per step
  uint64_t seed = 0;                    // draws seeds for requests that bring none
  int64_t logprobs_chunk_tokens = 1024;  // prompt positions whose [chunk, vocab] logits exist at once
  int64_t max_logprobs_k = 20;           // largest k of top-k logprobs and alternative draws a request may ask
  bool prefix_caching = true;            // keep finished rows' K/V for later prompts that start the same way
  // Prompts of mixed lengths prefill back to back in one row (varlen attention, each token's K/V written to its
  // request's cache row, a Gated DeltaNet's state at each prompt's end): no padded work.
  bool packed_prefill = true;
  DecodeMode decode_mode = DecodeMode::kEager;
};

/// NOTE: single owner (the engine thread); the model must outlive the generator.
class Generator {
 public:
  Generator(const models::CausalLM& model, const GeneratorConfig& config, std::vector<int64_t> eos_tokens,
            std::shared_ptr<const TokenBytes> token_bytes);

  /// Throws InvalidArgument when the request is malformed or can never fit (prompt + max_tokens >
  /// max_length, too many samples). Normalises the prompt to int64.
  void validate(SampleRequest& request) const;
  /// Validates and queues a request whose weights live in adapter `slot` (0 = base). Returns its id.
  /// `prefix_cache_key` names immutable weights (the base model, a snapshot) whose prompt prefixes may be reused;
  /// empty: weights that can change (a live adapter), never cached.
  int64_t submit(SampleRequest request, int64_t slot, std::string prefix_cache_key = "");
  /// Forgets the cached prefixes computed under `prefix_cache_key` (its weights are gone; the id may come back).
  void drop_prefix_cache(const std::string& prefix_cache_key);
  /// One iteration: prefill queued requests that fit (FIFO), then one decode step of every running
  /// sequence. Returns the requests that finished, by id.
  std::vector<std::pair<int64_t, SampleResult>> step();
  bool idle() const { return waiting_.empty() && running_ == 0; }
  /// Streaming: the tokens each sample of an unfinished request has generated so far (a finished sample's are
  /// final; stop strings are cut only when a sample finishes). Empty when `request_id` is not running.
  std::vector<std::vector<int64_t>> tokens_so_far(int64_t request_id) const;
  /// Adapter slots that queued or running requests still need (snapshot eviction must spare them).
  std::set<int64_t> slots_in_use() const;

 private:
  struct Request {
    SampleRequest request;
    int64_t slot = 0;
    SampleResult result;
    int64_t unfinished = 0;
    std::vector<int64_t> rows;
    std::string cache_key;       // PrefixCache key ("" = not cached)
    int64_t cached_prefix = 0;   // prompt tokens whose K/V were copied into rows.front() from the prefix cache
  };
  struct Sequence {
    int64_t request_id = 0, sample_index = 0, slot = 0;
    int64_t cached = 0;      // tokens whose K/V are in the cache
    int64_t last_token = 0;  // sampled, not yet in the cache
    at::Generator rng;
    std::unique_ptr<StopMatcher> stop;
    SampledSequence out;
  };

  std::vector<int64_t> admit();
  void prefill(const std::vector<int64_t>& request_ids);
  /// Claims `count` free rows for a request, evicting cached prefixes (least recently used, never `keep_row`).
  bool claim_rows(int64_t count, int64_t keep_row, std::vector<int64_t>& rows);
  /// Prefills prompt tokens [req.cached_prefix, P) into req.rows.front() after the copied prefix → [P - prefix, hidden].
  at::Tensor extend_prefill(const Request& req);
  void decode();
  /// A view of every layer's cache storage (K/V, recurrent states); callers add the step's rows and mode.
  models::KvCacheView cache_view() const;
  /// One eager decode step of cache rows [0, tokens.size()) → logits [active rows, vocab].
  at::Tensor eager_decode_logits(const std::vector<int64_t>& tokens, const std::vector<int64_t>& positions,
                                 const std::vector<int64_t>& slots, const std::vector<int64_t>& active,
                                 const std::vector<int64_t>& active_slots, int64_t attend_len) const;
  /// Samples one token for each listed row from logits [rows, V] and applies stop rules.
  void choose(const std::vector<int64_t>& rows, const at::Tensor& logits);
  void finish(int64_t row, const char* reason);
  at::Generator sequence_rng(const SampleRequest& request, int64_t sample_index);
  at::Generator prompt_rng(const SampleRequest& request);

  const models::CausalLM& model_;
  GeneratorConfig config_;
  std::vector<int64_t> eos_tokens_;
  std::shared_ptr<const TokenBytes> token_bytes_;
  KvCache cache_;
  PrefixCache prefix_cache_;
  std::unique_ptr<StaticDecoder> static_decoder_;  // null in eager mode
  at::Generator seed_source_;
  int64_t next_id_ = 1;
  std::deque<int64_t> waiting_;
  std::map<int64_t, Request> requests_;
  std::vector<std::optional<Sequence>> rows_;  // by KV cache row
  int64_t running_ = 0;
  std::vector<std::pair<int64_t, SampleResult>> finished_;
};

}  // namespace skyrl_tx::sampling
