// Generator: continuous batching over a KV cache: queued requests are prefilled into free rows and join
// the running decode batch; finished sequences leave it, so one long request never holds the others back.
#include "sampling/generator.h"

#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GradMode.h>

#include <algorithm>

#include "batching/packing.h"
#include "common/errors.h"
#include "sampling/sampler.h"

namespace skyrl_tx::sampling {
namespace {

// splitmix64: decorrelates the per-sample streams of one seeded request.
uint64_t mix_seed(uint64_t seed, uint64_t index) {
  uint64_t z = seed + 0x9E3779B97F4A7C15ULL * (index + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

at::Tensor device_tensor(const std::vector<int64_t>& values, at::Device device) {
  return at::tensor(values, at::TensorOptions().dtype(at::kLong)).to(device);
}

}  // namespace

Generator::Generator(const models::CausalLM& model, const GeneratorConfig& config, std::vector<int64_t> eos_tokens,
                     std::shared_ptr<const TokenBytes> token_bytes)
    : model_(model),
      config_(config),
      eos_tokens_(std::move(eos_tokens)),
      token_bytes_(std::move(token_bytes)),
      cache_(model.config(), config.max_sequences, config.max_length, model.options().dtype, model.options().device),
      seed_source_(at::make_generator<at::CPUGeneratorImpl>(config.seed)),
      rows_(config.max_sequences) {
  SKYRL_TX_CHECK(config.logprobs_chunk_tokens >= 1, InvalidArgument,
                 "sampling: logprobs_chunk_tokens must be >= 1 (got ", config.logprobs_chunk_tokens, ")");
  if (config.decode_mode != DecodeMode::kEager) {
    static_decoder_ = std::make_unique<StaticDecoder>(model, cache_, config.max_sequences, config.max_length,
                                                      config.decode_mode == DecodeMode::kCudaGraph);
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
                 "); max_sampling_sequences in --backend-config sets the upper bound");
  const int64_t total = request.prompt.numel() + request.params.max_tokens;
  SKYRL_TX_CHECK(total <= config_.max_length, InvalidArgument, "sample: prompt (", request.prompt.numel(),
                 " tokens) + max_tokens (", request.params.max_tokens, ") = ", total,
                 " exceeds max_sampling_length=", config_.max_length, "; shorten the prompt or lower max_tokens");
  SKYRL_TX_CHECK(request.topk_prompt_logprobs >= 0 && request.topk_prompt_logprobs <= vocab, InvalidArgument,
                 "sample: topk_prompt_logprobs must be in [0, ", vocab, "] (got ", request.topk_prompt_logprobs, ")");
  SKYRL_TX_CHECK(request.params.stop_strings.empty() || token_bytes_ != nullptr, InvalidArgument,
                 "sample: stop strings need the tokenizer's token bytes, which this backend was not given");
}

int64_t Generator::submit(SampleRequest request, int64_t slot) {
  validate(request);
  const int64_t id = next_id_++;
  Request& req = requests_[id];
  req.request = std::move(request);
  req.slot = slot;
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
    // FIFO admission: a request that does not fit yet waits for rows to free up (never an OOM).
    if (cache_.free_rows() < req.request.num_samples) break;
    if (!admitted.empty() && tokens + prompt_len > config_.prefill_token_budget) break;
    for (int64_t i = 0; i < req.request.num_samples; ++i) req.rows.push_back(cache_.allocate_row());
    tokens += prompt_len;
    admitted.push_back(waiting_.front());
    waiting_.pop_front();
  }
  return admitted;
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

void Generator::prefill(const std::vector<int64_t>& ids) {
  const at::Device device = model_.options().device;
  std::vector<at::Tensor> prompts;
  std::vector<int64_t> slots;
  for (int64_t id : ids) {
    prompts.push_back(requests_.at(id).request.prompt);
    slots.push_back(requests_.at(id).slot);
  }
  batching::PackedBatch batch =
      batching::pack_sequences(prompts, prompts, slots, model_.config().vocab_size, device);
  const int64_t T = batch.input_ids.size(1);
  // The prompt is prefilled once, into the request's first row; its other samples copy that prefix.
  std::vector<int64_t> cache_rows(ids.size()), last_token_index(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    cache_rows[batch.packed_row[i]] = requests_.at(ids[i]).rows.front();
    last_token_index[i] = batch.packed_row[i] * T + prompts[i].numel() - 1;
  }
  models::KvCacheView view;
  view.keys = &cache_.keys();
  view.values = &cache_.values();
  view.rows = device_tensor(cache_rows, device);
  // hidden: [B * T, hidden]
  at::Tensor hidden = model_.hidden_states(batch.input_ids, batch.positions, batch.mask, batch.segments, &view);
  at::Tensor last_hidden = hidden.index_select(0, device_tensor(last_token_index, device));  // [n, hidden]
  // logits: [n, vocab], requests in submission order (slots unsorted, so from_rows)
  at::Tensor logits = model_.lm_head().forward(last_hidden, lora::AdapterSegments::from_rows(slots, 1)).to(at::kFloat);

  std::vector<int64_t> new_rows, logits_row;
  for (size_t i = 0; i < ids.size(); ++i) {
    Request& req = requests_.at(ids[i]);
    const int64_t prompt_len = prompts[i].numel();
    if (req.request.prompt_logprobs || req.request.topk_prompt_logprobs > 0) {
      prompt_logprobs(req, hidden.narrow(0, batch.packed_row[i] * T, prompt_len));
    }
    cache_.copy_prefix(req.rows.front(), std::vector<int64_t>(req.rows.begin() + 1, req.rows.end()), prompt_len);
    for (int64_t s = 0; s < req.request.num_samples; ++s) {
      Sequence seq;
      seq.request_id = ids[i];
      seq.sample_index = s;
      seq.slot = req.slot;
      seq.cached = prompt_len;
      seq.rng = sequence_rng(req.request, s);
      const std::vector<int64_t> no_eos;
      seq.stop = std::make_unique<StopMatcher>(req.request.params.stop_at_eos ? eos_tokens_ : no_eos,
                                               req.request.params.stop_tokens,
                                               req.request.params.stop_strings, token_bytes_);
      const int64_t row = req.rows[s];
      rows_[row] = std::move(seq);
      ++running_;
      new_rows.push_back(row);
      logits_row.push_back(static_cast<int64_t>(i));
    }
  }
  choose(new_rows, logits.index_select(0, device_tensor(logits_row, device)));
}

void Generator::prompt_logprobs(Request& req, const at::Tensor& hidden) {
  const int64_t prompt_len = hidden.size(0), k = req.request.topk_prompt_logprobs;
  const int64_t scored = prompt_len - 1;  // position t scores prompt token t + 1; entry 0 has no prefix
  const at::Device device = hidden.device();
  at::Tensor logprobs = at::full({prompt_len}, NAN, at::kFloat);
  at::Tensor top_ids = at::full({prompt_len, k}, -1, at::kLong);
  at::Tensor top_logprobs = at::full({prompt_len, k}, NAN, at::kFloat);
  if (scored > 0) {
    const at::Tensor targets = req.request.prompt.narrow(0, 1, scored).to(device);  // [P - 1]
    // Chunked like training's target logprobs: only [chunk, vocab] logits (and their log-softmax) are alive
    // at once, not [P - 1, vocab] (~1.2 GB in float32 for a 2,048-token prompt over a 152k vocabulary).
    // Rows are independent, so each chunk's values are those of the whole-prompt log-softmax.
    const int64_t chunk = config_.logprobs_chunk_tokens;
    std::vector<at::Tensor> target_pieces, value_pieces, index_pieces;
    for (int64_t begin = 0; begin < scored; begin += chunk) {
      const int64_t length = std::min(chunk, scored - begin);
      at::Tensor logits = model_.lm_head().forward(hidden.narrow(0, begin, length),
                                                   lora::AdapterSegments::uniform(req.slot, length));
      at::Tensor log_probs = at::log_softmax(logits.to(at::kFloat), -1);  // [length, vocab]
      target_pieces.push_back(log_probs.gather(1, targets.narrow(0, begin, length).unsqueeze(1)).squeeze(1));
      if (k > 0) {
        auto [values, indices] = log_probs.topk(k, -1, /*largest=*/true, /*sorted=*/true);  // [length, k]
        value_pieces.push_back(values);
        index_pieces.push_back(indices);
      }
    }
    // One copy to the host per result, not one per chunk.
    logprobs.narrow(0, 1, scored).copy_(at::cat(target_pieces).cpu());
    if (k > 0) {
      top_ids.narrow(0, 1, scored).copy_(at::cat(index_pieces).cpu());
      top_logprobs.narrow(0, 1, scored).copy_(at::cat(value_pieces).cpu());
    }
  }
  req.result.prompt_logprobs = logprobs;
  if (k > 0) {
    req.result.topk_prompt_token_ids = top_ids;
    req.result.topk_prompt_logprobs = top_logprobs;
  }
}

void Generator::decode() {
  const at::Device device = model_.options().device;
  int64_t batch = 0;
  for (size_t row = 0; row < rows_.size(); ++row) {
    if (rows_[row]) batch = static_cast<int64_t>(row) + 1;
  }
  // Decode cache rows [0, batch): free rows in between ride along with token 0 and are discarded.
  std::vector<int64_t> tokens(batch, 0), positions(batch, 0), slots(batch, 0), active, active_slots;
  int64_t attend_len = 1;
  for (int64_t row = 0; row < batch; ++row) {
    if (!rows_[row]) continue;
    const Sequence& seq = *rows_[row];
    tokens[row] = seq.last_token;
    positions[row] = seq.cached;
    slots[row] = seq.slot;
    active.push_back(row);
    active_slots.push_back(seq.slot);
    attend_len = std::max(attend_len, seq.cached + 1);
  }
  at::Tensor logits;  // [active rows, vocab]
  if (static_decoder_) {
    at::Tensor all = static_decoder_->step(tokens, positions, slots, attend_len);  // [B, vocab] float
    logits = static_cast<int64_t>(active.size()) == batch ? all : all.index_select(0, device_tensor(active, device));
  } else {
    logits = eager_decode_logits(tokens, positions, slots, active, active_slots, attend_len);
  }
  for (int64_t row : active) rows_[row]->cached += 1;
  choose(active, logits.to(at::kFloat));
}

at::Tensor Generator::eager_decode_logits(const std::vector<int64_t>& tokens, const std::vector<int64_t>& positions,
                                          const std::vector<int64_t>& slots, const std::vector<int64_t>& active,
                                          const std::vector<int64_t>& active_slots, int64_t attend_len) const {
  const at::Device device = model_.options().device;
  const int64_t batch = static_cast<int64_t>(tokens.size());
  at::Tensor pos = device_tensor(positions, device);  // [B]
  models::KvCacheView view;
  view.keys = &cache_.keys();
  view.values = &cache_.values();
  view.decode = true;
  view.positions = pos;
  view.attend_len = attend_len;
  view.batch_rows = at::arange(batch, pos.options());  // [B], shared by every layer's cache write
  // Row b sees keys j <= position_b: its prompt, its completion so far and the token written now.
  view.attend_mask = (at::arange(attend_len, pos.options()).unsqueeze(0) <= pos.unsqueeze(1)).view({batch, 1, 1, attend_len});
  at::Tensor hidden = model_.hidden_states(device_tensor(tokens, device).view({batch, 1}), pos.view({batch, 1}),
                                           models::AttentionMask{}, lora::AdapterSegments::from_rows(slots, 1), &view);
  at::Tensor active_hidden = hidden.index_select(0, device_tensor(active, device));  // [n, hidden]
  return model_.lm_head().forward(active_hidden, lora::AdapterSegments::from_rows(active_slots, 1));
}

void Generator::choose(const std::vector<int64_t>& rows, const at::Tensor& logits) {
  const int64_t n = static_cast<int64_t>(rows.size());
  std::vector<float> temperature(n), top_p(n), uniform(n);
  std::vector<int64_t> top_k(n);
  for (int64_t i = 0; i < n; ++i) {
    Sequence& seq = *rows_[rows[i]];
    const SamplingParams& params = requests_.at(seq.request_id).request.params;
    temperature[i] = static_cast<float>(params.temperature);
    top_k[i] = params.top_k;
    top_p[i] = static_cast<float>(params.top_p);
    uniform[i] = at::rand({1}, seq.rng, at::kFloat).item<float>();  // the sequence's own stream
  }
  const at::Device device = logits.device();
  auto floats = [&](const std::vector<float>& v) { return at::tensor(v, at::kFloat).to(device); };
  RowSamplingParams params{floats(temperature), at::tensor(top_k, at::kLong).to(device), floats(top_p), floats(uniform)};
  params.all_untruncated = std::all_of(top_k.begin(), top_k.end(), [](int64_t k) { return k <= 0; }) &&
                           std::all_of(top_p.begin(), top_p.end(), [](float p) { return p >= 1.0f; });
  SampledTokens sampled = sample_tokens(logits, params);
  // The step's one device→host copy: stopping decisions need the tokens.
  at::Tensor tokens = sampled.tokens.cpu(), logprobs = sampled.logprobs.cpu();
  for (int64_t i = 0; i < n; ++i) {
    Sequence& seq = *rows_[rows[i]];
    const int64_t token = tokens[i].item<int64_t>();
    seq.out.tokens.push_back(token);
    seq.out.logprobs.push_back(logprobs[i].item<float>());
    const int64_t max_tokens = requests_.at(seq.request_id).request.params.max_tokens;
    if (seq.stop->accept(token)) {
      finish(rows[i], "stop");
    } else if (static_cast<int64_t>(seq.out.tokens.size()) >= max_tokens) {
      finish(rows[i], "length");
    } else {
      seq.last_token = token;
    }
  }
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
  req.result.sequences[seq.sample_index] = std::move(seq.out);
  rows_[row].reset();
  cache_.release_row(row);
  --running_;
  if (--req.unfinished == 0) {
    finished_.emplace_back(id, std::move(req.result));
    requests_.erase(id);
  }
}

}  // namespace skyrl_tx::sampling
