// Generator's model passes (see generator.h): packed or padded prefill of admitted requests into their KV-cache
// rows, one decode step over the running rows (static / CUDA-graph decoder or eager), and choosing each row's next
// token from its logits. Admission, queueing and finishing live in generator.cpp.
#include "sampling/generator.h"

#include <algorithm>

#include "batching/packing.h"
#include "sampling/prompt_scoring.h"
#include "sampling/sampler.h"

namespace skyrl_tx::sampling {
namespace {

at::Tensor device_tensor(const std::vector<int64_t>& values, at::Device device) {
  return at::tensor(values, at::TensorOptions().dtype(at::kLong)).to(device);
}

}  // namespace

void Generator::prefill(const std::vector<int64_t>& ids) {
  const at::Device device = model_.options().device;
  // Per request: the hidden states of prompt rows [offset, P) (offset = its cached prefix) and its last row.
  std::vector<at::Tensor> prompt_hidden(ids.size()), last_hidden(ids.size());
  std::vector<int64_t> slots(ids.size()), fresh;  // fresh: requests prefilled from position 0, packed together
  for (size_t i = 0; i < ids.size(); ++i) {
    const Request& req = requests_.at(ids[i]);
    slots[i] = req.slot;
    if (req.cached_prefix > 0) {
      prompt_hidden[i] = extend_prefill(req);  // [P - prefix, hidden]
    } else {
      fresh.push_back(static_cast<int64_t>(i));
    }
  }
  if (!fresh.empty()) {
    std::vector<at::Tensor> prompts;
    std::vector<int64_t> fresh_slots;
    for (int64_t i : fresh) {
      prompts.push_back(requests_.at(ids[i]).request.prompt);
      fresh_slots.push_back(slots[i]);
    }
    batching::PackedBatch batch =
        batching::pack_sequences(prompts, prompts, fresh_slots, model_.config().vocab_size, device,
                                 config_.packed_prefill ? batching::RowLayout::kPacked : batching::RowLayout::kPadded);
    // The prompt is prefilled once, into the request's first row; its other samples copy that prefix.
    models::KvCacheView view = cache_view();
    if (batch.packed()) {  // [1, total]: each token's K/V goes to its request's row at its position
      std::vector<int64_t> request_row(fresh.size());
      for (size_t j = 0; j < fresh.size(); ++j) request_row[j] = requests_.at(ids[fresh[j]]).rows.front();
      view.token_rows = device_tensor(request_row, device).index_select(0, batch.token_request);  // [total]
      view.token_positions = batch.positions.view({-1});                                         // [total]
    } else {
      std::vector<int64_t> cache_rows(fresh.size()), row_lengths(fresh.size());
      for (size_t j = 0; j < fresh.size(); ++j) {
        cache_rows[batch.packed_row[j]] = requests_.at(ids[fresh[j]]).rows.front();
        row_lengths[batch.packed_row[j]] = prompts[j].numel();
      }
      view.rows = device_tensor(cache_rows, device);
      view.lengths = device_tensor(row_lengths, device);  // Gated DeltaNet layers keep each row's state at its end
    }
    // hidden: [B * T, hidden]
    at::Tensor hidden = model_.hidden_states(batch.input_ids, batch.positions, batch.mask, batch.segments, &view);
    for (size_t j = 0; j < fresh.size(); ++j) {
      prompt_hidden[fresh[j]] = hidden.narrow(0, batch.token_offset[j], prompts[j].numel());  // [P, hidden]
    }
  }
  for (size_t i = 0; i < ids.size(); ++i) last_hidden[i] = prompt_hidden[i].narrow(0, prompt_hidden[i].size(0) - 1, 1);
  // logits: [n, vocab], requests in submission order (slots unsorted, so from_rows)
  at::Tensor logits =
      model_.logits(at::cat(last_hidden), lora::AdapterSegments::from_rows(slots, 1)).to(at::kFloat);

  std::vector<int64_t> new_rows, logits_row;
  for (size_t i = 0; i < ids.size(); ++i) {
    Request& req = requests_.at(ids[i]);
    const int64_t prompt_len = req.request.prompt.numel();
    req.result.prompt_cache_hit_tokens = req.cached_prefix;
    if (wants_prompt_scores(req.request)) {
      // Only alternative draws use randomness: other prompt scores leave the seed streams as they were.
      at::Generator rng = req.request.prompt_alt_tokens_k > 0 ? prompt_rng(req.request) : at::Generator();
      score_prompt(model_, req.request, req.slot, prompt_hidden[i], req.cached_prefix, config_.logprobs_chunk_tokens,
                   rng, req.result);
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

at::Tensor Generator::extend_prefill(const Request& req) {
  const at::Device device = model_.options().device;
  const int64_t start = req.cached_prefix, length = req.request.prompt.numel() - start;
  at::Tensor ids = req.request.prompt.narrow(0, start, length).to(device).view({1, length});  // [1, T]
  at::Tensor positions = at::arange(start, start + length, ids.options()).view({1, length});  // [1, T]
  models::KvCacheView view = cache_view();
  view.extend = true;
  view.extend_row = req.rows.front();
  view.extend_start = start;
  // Query i (position start + i) sees keys j <= start + i: the cached prefix and the new tokens up to itself.
  at::Tensor keys = at::arange(start + length, ids.options()).view({1, start + length});                 // [1, L]
  view.attend_mask = (keys <= positions.view({length, 1})).view({1, 1, length, start + length});           // bool
  return model_.hidden_states(ids, positions, models::AttentionMask{}, lora::AdapterSegments::uniform(req.slot, length),
                              &view);  // [T, hidden]
}

models::KvCacheView Generator::cache_view() const {
  models::KvCacheView view;
  view.keys = &cache_.keys();
  view.values = &cache_.values();
  view.conv_states = &cache_.conv_states();
  view.recurrent_states = &cache_.recurrent_states();
  return view;
}

void Generator::decode() {
  const at::Device device = model_.options().device;
  int64_t batch = 0;
  for (size_t row = 0; row < rows_.size(); ++row) {
    if (rows_[row]) batch = static_cast<int64_t>(row) + 1;
  }
  // Free or prefix-cached rows in between ride along at the last position, which no cached prefix holds.
  std::vector<int64_t> tokens(batch, 0), positions(batch, config_.max_length - 1), slots(batch, 0), active, active_slots;
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
  models::KvCacheView view = cache_view();
  view.decode = true;
  view.positions = pos;
  view.attend_len = attend_len;
  view.batch_rows = at::arange(batch, pos.options());  // [B], shared by every layer's cache write
  // Row b sees keys j <= position_b: its prompt, its completion so far and the token written now.
  view.attend_mask = (at::arange(attend_len, pos.options()).unsqueeze(0) <= pos.unsqueeze(1)).view({batch, 1, 1, attend_len});
  at::Tensor hidden = model_.hidden_states(device_tensor(tokens, device).view({batch, 1}), pos.view({batch, 1}),
                                           models::AttentionMask{}, lora::AdapterSegments::from_rows(slots, 1), &view);
  at::Tensor active_hidden = hidden.index_select(0, device_tensor(active, device));  // [n, hidden]
  return model_.logits(active_hidden, lora::AdapterSegments::from_rows(active_slots, 1));
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
  // The step's device→host copies: stopping decisions need the tokens.
  at::Tensor tokens = sampled.tokens.cpu(), logprobs = sampled.logprobs.cpu();
  int64_t top_k_max = 0;
  for (int64_t i = 0; i < n; ++i) {
    top_k_max = std::max(top_k_max, requests_.at(rows_[rows[i]]->request_id).request.topk_sample_logprobs);
  }
  at::Tensor top_ids, top_logprobs;  // [n, top_k_max] when some row asks for its top k
  if (top_k_max > 0) {
    auto [values, indices] = at::log_softmax(logits.to(at::kFloat), -1).topk(top_k_max, -1, true, true);
    top_ids = indices.cpu().contiguous();
    top_logprobs = values.cpu().contiguous();
  }
  for (int64_t i = 0; i < n; ++i) {
    Sequence& seq = *rows_[rows[i]];
    const int64_t token = tokens[i].item<int64_t>();
    seq.out.tokens.push_back(token);
    seq.out.logprobs.push_back(logprobs[i].item<float>());
    if (const int64_t k = requests_.at(seq.request_id).request.topk_sample_logprobs; k > 0) {
      const int64_t* ids = top_ids.data_ptr<int64_t>() + i * top_k_max;
      const float* values = top_logprobs.data_ptr<float>() + i * top_k_max;
      seq.out.topk_token_ids.insert(seq.out.topk_token_ids.end(), ids, ids + k);
      seq.out.topk_logprobs.insert(seq.out.topk_logprobs.end(), values, values + k);
    }
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

}  // namespace skyrl_tx::sampling
