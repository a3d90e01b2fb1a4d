// Tests sampling::Generator on a tiny random CausalLM: greedy decoding vs a no-cache reference loop, continuous
// batching, stop tokens, prompt logprobs and submit-time validation.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <cmath>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "common/errors.h"
#include "models/causal_lm.h"
#include "sampling/generator.h"
#include "testing/tensor_asserts.h"
#include "testing/tiny_model.h"

namespace skyrl_tx::sampling {
namespace {

using skyrl_tx::testing::make_gen;
using skyrl_tx::testing::random_tokens;

struct Greedy {
  std::vector<int64_t> tokens;
  std::vector<float> logprobs;
};

models::ModelOptions tiny_options() {
  models::ModelOptions o;
  o.num_slots = 2;
  o.max_rank = 4;
  return o;
}

class GeneratorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    config_ = skyrl_tx::testing::tiny_qwen3_config();
    model_ = std::make_unique<models::CausalLM>(config_, skyrl_tx::testing::random_weights(config_, 123),
                                                tiny_options());
    gen_config_.max_sequences = 4;
    gen_config_.max_length = 32;
  }

  // Log-softmax over the vocabulary at every position of `ids` [T] → [T, V], full forward, no KV cache.
  at::Tensor full_log_probs(const at::Tensor& ids) const {
    c10::NoGradGuard no_grad;
    const int64_t t = ids.numel();
    auto segments = lora::AdapterSegments::uniform(0, t);
    at::Tensor hidden = model_->hidden_states(ids.unsqueeze(0), at::arange(t, at::kLong).unsqueeze(0),
                                              models::AttentionMask{}, segments);
    at::Tensor logits = model_->lm_head().forward(hidden, segments);
    return at::log_softmax(logits.to(at::kFloat), -1);
  }

  // Reference greedy decoding: recomputes the whole sequence at every step.
  Greedy reference_greedy(const at::Tensor& prompt, int64_t max_tokens) const {
    Greedy out;
    at::Tensor ids = prompt.to(at::kLong);
    for (int64_t i = 0; i < max_tokens; ++i) {
      at::Tensor last = full_log_probs(ids)[ids.numel() - 1];
      const int64_t token = last.argmax().item<int64_t>();
      out.tokens.push_back(token);
      out.logprobs.push_back(last[token].item<float>());
      ids = at::cat({ids, at::tensor({token}, at::kLong)});
    }
    return out;
  }

  SampleRequest greedy_request(const at::Tensor& prompt, int64_t max_tokens) const {
    SampleRequest r;
    r.prompt = prompt;
    r.params.max_tokens = max_tokens;
    r.params.temperature = 0.0;
    r.params.seed = 7;
    return r;
  }

  // Submits every request to a fresh generator and steps until idle; results by submission order.
  // `slots`: each request's adapter slot (default: all 0, the base model).
  std::vector<SampleResult> run(std::vector<SampleRequest> requests, const GeneratorConfig& cfg,
                                const std::vector<int64_t>& slots = {}) const {
    Generator g(*model_, cfg, /*eos_tokens=*/{}, nullptr);
    std::vector<int64_t> ids;
    for (size_t i = 0; i < requests.size(); ++i) ids.push_back(g.submit(std::move(requests[i]), slots.empty() ? 0 : slots[i]));
    std::map<int64_t, SampleResult> done;
    for (int iter = 0; iter < 1000 && !g.idle(); ++iter) {
      for (auto& [id, result] : g.step()) done.emplace(id, std::move(result));
    }
    EXPECT_TRUE(g.idle());
    std::vector<SampleResult> out;
    for (int64_t id : ids) {
      auto it = done.find(id);
      EXPECT_TRUE(it != done.end()) << "request " << id << " never finished";
      out.push_back(it == done.end() ? SampleResult{} : std::move(it->second));
    }
    return out;
  }

  void expect_matches(const SampledSequence& seq, const Greedy& ref) const {
    EXPECT_EQ(seq.tokens, ref.tokens);
    ASSERT_EQ(seq.logprobs.size(), ref.logprobs.size());
    for (size_t i = 0; i < ref.logprobs.size(); ++i) EXPECT_NEAR(seq.logprobs[i], ref.logprobs[i], 1e-5) << "token " << i;
  }

  at::Tensor prompt(int64_t len, uint64_t seed) const {
    at::Generator gen = make_gen(seed);
    return random_tokens(len, config_.vocab_size, gen);
  }

  models::ModelConfig config_;
  std::unique_ptr<models::CausalLM> model_;
  GeneratorConfig gen_config_;
};

// The static decode path (rows and keys rounded up to buckets, row-dense LoRA: what a CUDA graph captures)
// samples exactly what the eager path samples, with an adapter on some requests and rows joining and leaving.
TEST_F(GeneratorTest, StaticDecodeEqualsEager) {
  {
    c10::NoGradGuard no_grad;
    at::Generator gen = make_gen(99);
    for (const auto& m : model_->lora_modules()) {
      m.module->enable_slot(1, 4, 2.0, gen);
      m.module->set_factors(1, m.module->lora_a(1), at::randn({m.module->out_features(), 4}, gen) * 0.5);
    }
  }
  const std::vector<int64_t> lengths = {6, 3, 9, 4, 2}, max_tokens = {8, 3, 5, 12, 6}, slots = {1, 0, 1, 0, 1};
  auto requests = [&] {
    std::vector<SampleRequest> out;
    for (size_t i = 0; i < lengths.size(); ++i) {
      SampleRequest r;
      r.prompt = prompt(lengths[i], 40 + i);
      r.params.max_tokens = max_tokens[i];
      r.params.temperature = 1.0;  // seeded sampling: the same draws on both paths
      r.params.seed = 100 + i;
      out.push_back(std::move(r));
    }
    return out;
  };
  GeneratorConfig eager = gen_config_;
  eager.max_sequences = 3;  // not a power of two: the row bucket is capped
  GeneratorConfig fixed = eager;
  fixed.decode_mode = DecodeMode::kStatic;
  const auto ref = run(requests(), eager, slots), got = run(requests(), fixed, slots);
  ASSERT_EQ(ref.size(), got.size());
  for (size_t i = 0; i < ref.size(); ++i) {
    ASSERT_EQ(got[i].sequences.size(), 1u);
    const SampledSequence &a = got[i].sequences[0], &b = ref[i].sequences[0];
    EXPECT_EQ(a.tokens, b.tokens) << "request " << i;
    ASSERT_EQ(a.logprobs.size(), b.logprobs.size());
    for (size_t t = 0; t < a.logprobs.size(); ++t) EXPECT_NEAR(a.logprobs[t], b.logprobs[t], 1e-5) << i << ":" << t;
  }
  // The adapter changes what is sampled (the comparison above is not base vs base).
  auto base = run(requests(), eager, std::vector<int64_t>(lengths.size(), 0));
  EXPECT_NE(base[0].sequences[0].logprobs, ref[0].sequences[0].logprobs);
}

TEST_F(GeneratorTest, GreedyMatchesNoCacheReference) {
  const at::Tensor p = prompt(7, 1);
  auto results = run({greedy_request(p, 10)}, gen_config_);
  ASSERT_EQ(results.size(), 1u);
  ASSERT_EQ(results[0].sequences.size(), 1u);
  const SampledSequence& seq = results[0].sequences[0];
  expect_matches(seq, reference_greedy(p, 10));
  EXPECT_EQ(seq.stop_reason, "length");
  EXPECT_FALSE(results[0].prompt_logprobs.defined());
}

TEST_F(GeneratorTest, GreedySamplesAreIdentical) {
  const at::Tensor p = prompt(5, 2);
  SampleRequest r = greedy_request(p, 6);
  r.num_samples = 3;
  auto results = run({r}, gen_config_);
  ASSERT_EQ(results[0].sequences.size(), 3u);
  const Greedy ref = reference_greedy(p, 6);
  for (const auto& seq : results[0].sequences) {
    expect_matches(seq, ref);
    EXPECT_EQ(seq.tokens, results[0].sequences[0].tokens);
  }
}

TEST_F(GeneratorTest, ContinuousBatchingFinishesEveryRequestAsIfAlone) {
  GeneratorConfig cfg = gen_config_;
  cfg.max_sequences = 2;
  const std::vector<at::Tensor> prompts = {prompt(6, 3), prompt(3, 4), prompt(9, 5)};
  const std::vector<int64_t> max_tokens = {8, 3, 5};
  std::vector<SampleRequest> reqs;
  for (size_t i = 0; i < prompts.size(); ++i) reqs.push_back(greedy_request(prompts[i], max_tokens[i]));
  auto together = run(reqs, cfg);
  ASSERT_EQ(together.size(), 3u);
  for (size_t i = 0; i < prompts.size(); ++i) {
    SCOPED_TRACE("request " + std::to_string(i));
    ASSERT_EQ(together[i].sequences.size(), 1u);
    auto alone = run({greedy_request(prompts[i], max_tokens[i])}, cfg);
    EXPECT_EQ(together[i].sequences[0].tokens, alone[0].sequences[0].tokens);
    expect_matches(together[i].sequences[0], reference_greedy(prompts[i], max_tokens[i]));
    EXPECT_EQ(together[i].sequences[0].stop_reason, "length");
  }
}

TEST_F(GeneratorTest, StopTokenEndsTheOutputAfterIt) {
  const at::Tensor p = prompt(5, 6);
  const Greedy ref = reference_greedy(p, 8);
  const int64_t stop = ref.tokens[1];
  ASSERT_NE(ref.tokens[0], stop) << "pick a prompt whose first two greedy tokens differ";
  SampleRequest r = greedy_request(p, 8);
  r.params.stop_tokens = {stop};
  auto results = run({r}, gen_config_);
  const SampledSequence& seq = results[0].sequences[0];
  // The output ends right after the first occurrence of the stop token (index 1, or 0 if repeated).
  size_t end = 0;
  while (ref.tokens[end] != stop) ++end;
  const std::vector<int64_t> expected(ref.tokens.begin(), ref.tokens.begin() + static_cast<int64_t>(end) + 1);
  EXPECT_EQ(seq.tokens, expected);
  EXPECT_EQ(seq.tokens.back(), stop);
  EXPECT_EQ(seq.stop_reason, "stop");
  EXPECT_EQ(seq.logprobs.size(), seq.tokens.size());
}

TEST_F(GeneratorTest, EosStopsUnlessStopAtEosIsOff) {
  const at::Tensor p = prompt(4, 7);
  const Greedy ref = reference_greedy(p, 6);
  const int64_t eos = ref.tokens[0];
  GeneratorConfig cfg = gen_config_;
  {
    Generator g(*model_, cfg, {eos}, nullptr);
    g.submit(greedy_request(p, 6), 0);
    std::vector<std::pair<int64_t, SampleResult>> done;
    while (!g.idle()) for (auto& d : g.step()) done.push_back(std::move(d));
    ASSERT_EQ(done.size(), 1u);
    EXPECT_EQ(done[0].second.sequences[0].tokens, std::vector<int64_t>{eos});
    EXPECT_EQ(done[0].second.sequences[0].stop_reason, "stop");
  }
  {
    Generator g(*model_, cfg, {eos}, nullptr);
    SampleRequest r = greedy_request(p, 6);
    r.params.stop_at_eos = false;
    g.submit(r, 0);
    std::vector<std::pair<int64_t, SampleResult>> done;
    while (!g.idle()) for (auto& d : g.step()) done.push_back(std::move(d));
    ASSERT_EQ(done.size(), 1u);
    EXPECT_EQ(done[0].second.sequences[0].tokens, ref.tokens);
    EXPECT_EQ(done[0].second.sequences[0].stop_reason, "length");
  }
}

TEST_F(GeneratorTest, PromptLogprobsMatchReference) {
  const at::Tensor p = prompt(8, 8);
  SampleRequest r = greedy_request(p, 2);
  r.prompt_logprobs = true;
  r.topk_prompt_logprobs = 3;
  auto results = run({r}, gen_config_);
  const at::Tensor lp = results[0].prompt_logprobs;
  ASSERT_TRUE(lp.defined());
  ASSERT_EQ(lp.numel(), 8);
  EXPECT_TRUE(std::isnan(lp[0].item<float>()));
  at::Tensor log_probs = full_log_probs(p).narrow(0, 0, 7);  // position t scores token t + 1
  at::Tensor expected = log_probs.gather(1, p.narrow(0, 1, 7).unsqueeze(1)).squeeze(1);
  EXPECT_TENSOR_CLOSE(lp.narrow(0, 1, 7), expected, 1e-5, 1e-5);
  auto [values, indices] = log_probs.topk(3, -1);
  ASSERT_TRUE(results[0].topk_prompt_logprobs.defined());
  EXPECT_TENSOR_CLOSE(results[0].topk_prompt_logprobs.narrow(0, 1, 7), values, 1e-5, 1e-5);
  EXPECT_TENSOR_EQ(results[0].topk_prompt_token_ids.narrow(0, 1, 7), indices);
  // And the completion is still the greedy one.
  expect_matches(results[0].sequences[0], reference_greedy(p, 2));
}

TEST_F(GeneratorTest, ChunkedPromptLogprobsEqualUnchunked) {
  // A 23-token prompt scored 3 positions at a time (8 chunks, the last one short) against one chunk.
  const at::Tensor p = prompt(23, 12);
  SampleRequest r = greedy_request(p, 2);
  r.prompt_logprobs = true;
  r.topk_prompt_logprobs = 4;
  GeneratorConfig chunked = gen_config_, whole = gen_config_;
  chunked.logprobs_chunk_tokens = 3;
  whole.logprobs_chunk_tokens = 1024;
  const SampleResult a = run({r}, chunked)[0], b = run({r}, whole)[0];
  ASSERT_EQ(a.prompt_logprobs.numel(), 23);
  EXPECT_TENSOR_CLOSE(a.prompt_logprobs.narrow(0, 1, 22), b.prompt_logprobs.narrow(0, 1, 22), 1e-6, 1e-6);
  EXPECT_TENSOR_CLOSE(a.topk_prompt_logprobs.narrow(0, 1, 22), b.topk_prompt_logprobs.narrow(0, 1, 22), 1e-6, 1e-6);
  EXPECT_TENSOR_EQ(a.topk_prompt_token_ids, b.topk_prompt_token_ids);
  // And both are the whole-prompt log-softmax.
  at::Tensor log_probs = full_log_probs(p).narrow(0, 0, 22);
  EXPECT_TENSOR_CLOSE(a.prompt_logprobs.narrow(0, 1, 22),
                      log_probs.gather(1, p.narrow(0, 1, 22).unsqueeze(1)).squeeze(1), 1e-5, 1e-5);
  GeneratorConfig zero = gen_config_;
  zero.logprobs_chunk_tokens = 0;
  EXPECT_THROW(Generator(*model_, zero, {}, nullptr), InvalidArgument);
}

TEST_F(GeneratorTest, SubmitRejectsRequestsThatCanNeverFit) {
  Generator g(*model_, gen_config_, {}, nullptr);
  EXPECT_THROW(g.submit(greedy_request(prompt(10, 9), 23), 0), InvalidArgument);  // 33 > 32
  EXPECT_NO_THROW(g.submit(greedy_request(prompt(10, 9), 22), 0));                // exactly 32
  SampleRequest many = greedy_request(prompt(4, 10), 2);
  many.num_samples = gen_config_.max_sequences + 1;
  EXPECT_THROW(g.submit(many, 0), InvalidArgument);
  SampleRequest bad_token = greedy_request(at::tensor({1, 2, static_cast<int>(config_.vocab_size)}, at::kLong), 2);
  EXPECT_THROW(g.submit(bad_token, 0), InvalidArgument);
  SampleRequest empty = greedy_request(at::zeros({0}, at::kLong), 2);
  EXPECT_THROW(g.submit(empty, 0), InvalidArgument);
}

TEST_F(GeneratorTest, NumSamplesAboveMaxSequencesIsInvalid) {
  GeneratorConfig cfg = gen_config_;
  cfg.max_sequences = 2;
  Generator g(*model_, cfg, {}, nullptr);
  SampleRequest r = greedy_request(prompt(4, 11), 2);
  r.num_samples = 3;
  EXPECT_THROW(g.submit(r, 0), InvalidArgument);
  r.num_samples = 2;
  EXPECT_NO_THROW(g.submit(r, 0));
}

}  // namespace
}  // namespace skyrl_tx::sampling
