// Generator: continuous batching over a KV cache: queued requests are prefilled into free rows and join
// the running decode batch; finished sequences leave it, so one long request never holds the others back.
// This file: validation, queueing, admission, random streams and finishing; the model passes (prefill, decode,
// choosing tokens) are in generator_passes.cpp.
#include "sampling/generator.h"

#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GradMode.h>

#include <algorithm>

#include "common/errors.h"
#include "sampling/prompt_scoring.h"

namespace skyrl_tx::sampling {
namespace {

// splitmix64: decorrelates the per-sample streams of one seeded request.
uint64_t mix_seed(uint64_t seed, uint64_t index) {
  uint64_t z = seed + 0x9E3779B97F4A7C15ULL * (index + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

}  // namespace

Generator::Generator(const models::CausalLM& model, const GeneratorConfig& config, std::vector<int64_t> eos_tokens,
                     std::shared_ptr<const TokenBytes> token_bytes)
    : model_(model),
      config_(config),
      eos_tokens_(std::move(eos_tokens)),
      token_bytes_(std::move(token_bytes)),
      cache_(model.config(), config.max_sequences, config.max_length, model.options().dtype, model.options().device,
             model.tensor_parallel().size()),
      seed_source_(at::make_generator<at::CPUGeneratorImpl>(config.seed)),
      rows_(config.max_sequences) {
  // A Gated DeltaNet's state exists only after a row's last token, never at an earlier prefix: nothing to reuse.
  // And its decode step updates per-row states that the static (CUDA graph) decoder does not manage: eager.
  if (model.config().has_linear_attention()) {
    config_.prefix_caching = false;
    config_.decode_mode = DecodeMode::kEager;
  }
  SKYRL_TX_CHECK(config.logprobs_chunk_tokens >= 1, InvalidArgument,
                 "sampling: logprobs_chunk_tokens must be >= 1 (got ", config.logprobs_chunk_tokens, ")");
  if (config_.decode_mode != DecodeMode::kEager) {
    static_decoder_ = std::make_unique<StaticDecoder>(model, cache_, config.max_sequences, config.max_length,
                                                      config_.decode_mode == DecodeMode::kCudaGraph);
  }
}

void Generator::validate(SampleRequest& request) const {
  const int64_t vocab = model_.config().vocab_size;
  request.params.validate(vocab);
  SKYRL_TX_CHECK(request.prompt.defined() && request.prompt.dim() == 1 && request.prompt.numel() >= 1, InvalidArgument,
                 "sample: prompt must hold at least one token");
  request.prompt = request.prompt.to(at::kLong).contiguous();
  const int64_t lo = request.prompt.min().item<int64_t>(), hi = request.prompt.max().item<int64_t>();
  SKYRL_TX_CHECK(lo >= 0 && hi < vocab, InvalidArgument, "sample: prompt token id ", (lo < 0 ? lo : hi),
                 " is outside [0, ", vocab, ")");
  SKYRL_TX_CHECK(request.num_samples >= 1 && request.num_samples <= config_.max_sequences, InvalidArgument,
                 "sample: num_samples must be in [1, ", config_.max_sequences, "] (got ", request.num_samples,
                 "): the KV cache's rows, set by max_sampling_sequences, kv_cache_tokens or gpu_memory_utilization in "
                 "--backend-config");
  const int64_t total = request.prompt.numel() + request.params.max_tokens;
  SKYRL_TX_CHECK(total <= config_.max_length, InvalidArgument, "sample: prompt (", request.prompt.numel(),
                 " tokens) + max_tokens (", request.params.max_tokens, ") = ", total,
                 " exceeds max_sampling_length=", config_.max_length, "; shorten the prompt or lower max_tokens");
  validate_prompt_scoring(request, vocab, config_.max_logprobs_k);
  SKYRL_TX_CHECK(request.params.stop_strings.empty() || token_bytes_ != nullptr, InvalidArgument,
                 "sample: stop strings need the tokenizer's token bytes, which this backend was not given");
}

int64_t Generator::submit(SampleRequest request, int64_t slot, std::string prefix_cache_key) {
  validate(request);
  const int64_t id = next_id_++;
  Request& req = requests_[id];
  req.request = std::move(request);
  req.slot = slot;
  req.cache_key = config_.prefix_caching ? std::move(prefix_cache_key) : std::string();
  req.unfinished = req.request.num_samples;
  req.result.sequences.resize(req.request.num_samples);
  waiting_.push_back(id);
  return id;
}

std::set<int64_t> Generator::slots_in_use() const {
  std::set<int64_t> slots;
  for (const auto& [id, req] : requests_) slots.insert(req.slot);
  return slots;
}

std::vector<std::pair<int64_t, SampleResult>> Generator::step() {
  c10::NoGradGuard no_grad;
  std::vector<int64_t> admitted = admit();
  if (!admitted.empty()) prefill(admitted);
  if (running_ > 0) decode();
  return std::exchange(finished_, {});
}

std::vector<int64_t> Generator::admit() {
  std::vector<int64_t> admitted;
  int64_t tokens = 0;
  while (!waiting_.empty()) {
    Request& req = requests_.at(waiting_.front());
    const int64_t prompt_len = req.request.prompt.numel();
    // The longest cached prefix of the prompt, short of the first position the request scores (its hidden state
    // is needed) and of the last token (its logits start the sampling).
    PrefixCache::Hit hit;
    if (!req.cache_key.empty()) {
      const int64_t* ids = req.request.prompt.data_ptr<int64_t>();
      hit = prefix_cache_.lookup(req.cache_key, std::vector<int64_t>(ids, ids + prompt_len),
                                 first_scored_row(req.request));
    }
    if (!admitted.empty() && tokens + prompt_len - hit.length > config_.prefill_token_budget) break;
    // FIFO admission: a request that does not fit yet waits for rows to free up (never an OOM).
    if (claim_rows(req.request.num_samples, hit.row, req.rows)) {
      if (hit.length > 0) {  // copied now: a later request's eviction may reuse the cached row
        cache_.copy_prefix(hit.row, {req.rows.front()}, hit.length);
        req.cached_prefix = hit.length;
      }
    } else if (hit.row >= 0 && claim_rows(req.request.num_samples - 1, hit.row, req.rows)) {
      // It needs the hit's row too (every row): that row becomes its first, its K/V already in place.
      prefix_cache_.take(hit.row);
      req.rows.insert(req.rows.begin(), hit.row);
      req.cached_prefix = hit.length;
    } else {
      break;
    }
    tokens += prompt_len - hit.length;
    admitted.push_back(waiting_.front());
    waiting_.pop_front();
  }
  return admitted;
}

bool Generator::claim_rows(int64_t count, int64_t keep_row, std::vector<int64_t>& rows) {
  while (cache_.free_rows() < count) {
    const int64_t row = prefix_cache_.evict_lru(keep_row);
    if (row < 0) return false;
    cache_.release_row(row);
  }
  for (int64_t i = 0; i < count; ++i) rows.push_back(cache_.allocate_row());
  return true;
}

void Generator::drop_prefix_cache(const std::string& prefix_cache_key) {
  for (int64_t row : prefix_cache_.drop(prefix_cache_key)) cache_.release_row(row);
}

at::Generator Generator::sequence_rng(const SampleRequest& request, int64_t sample_index) {
  uint64_t seed = 0;
  if (request.params.seed.has_value()) {
    seed = mix_seed(*request.params.seed, static_cast<uint64_t>(sample_index));
  } else {
    seed = static_cast<uint64_t>(at::randint(0, INT64_MAX, {1}, seed_source_, at::kLong).item<int64_t>());
  }
  return at::make_generator<at::CPUGeneratorImpl>(seed);
}

at::Generator Generator::prompt_rng(const SampleRequest& request) {
  // Its own stream, apart from every sample's: asking for alternative draws never changes the samples.
  constexpr uint64_t kPromptStream = 0xA1700000ULL;
  uint64_t seed = 0;
  if (request.params.seed.has_value()) {
    seed = mix_seed(*request.params.seed ^ kPromptStream, 0);
  } else {
    seed = static_cast<uint64_t>(at::randint(0, INT64_MAX, {1}, seed_source_, at::kLong).item<int64_t>());
  }
  return at::make_generator<at::CPUGeneratorImpl>(seed);
}

std::vector<std::vector<int64_t>> Generator::tokens_so_far(int64_t request_id) const {
  auto it = requests_.find(request_id);
  if (it == requests_.end()) return {};
  std::vector<std::vector<int64_t>> out;
  for (const SampledSequence& done : it->second.result.sequences) out.push_back(done.tokens);  // finished samples
  for (const auto& row : rows_) {
    if (row && row->request_id == request_id) out[row->sample_index] = row->out.tokens;  // still decoding
  }
  return out;
}

void Generator::finish(int64_t row, const char* reason) {
  Sequence& seq = *rows_[row];
  seq.out.stop_reason = reason;
  const int64_t id = seq.request_id;
  Request& req = requests_.at(id);
  std::vector<int64_t> released{row};
  if (!req.cache_key.empty()) {  // keep the row: its K/V hold the prompt and every token fed back so far
    const int64_t* prompt = req.request.prompt.data_ptr<int64_t>();
    const int64_t prompt_len = req.request.prompt.numel();
    std::vector<int64_t> held(prompt, prompt + prompt_len);
    const int64_t fed = std::min<int64_t>(seq.cached - prompt_len, static_cast<int64_t>(seq.out.tokens.size()));
    held.insert(held.end(), seq.out.tokens.begin(), seq.out.tokens.begin() + fed);
    released = prefix_cache_.insert(req.cache_key, std::move(held), row);
  }
  req.result.sequences[seq.sample_index] = std::move(seq.out);
  rows_[row].reset();
  for (int64_t r : released) cache_.release_row(r);
  --running_;
  if (--req.unfinished == 0) {
    finished_.emplace_back(id, std::move(req.result));
    requests_.erase(id);
  }
}

}  // namespace skyrl_tx::sampling
