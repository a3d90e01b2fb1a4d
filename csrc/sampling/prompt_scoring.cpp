// score_prompt: prompt logprobs, top-k, target-id logprobs and alternative draws, chunked over the prompt.
#include "sampling/prompt_scoring.h"

#include <algorithm>
#include <cmath>

#include "common/dtype.h"
#include "common/errors.h"

namespace skyrl_tx::sampling {
namespace {

// k draws per row from softmax(logits / temperature) by inverse CDF over token ids (the sampler's rule: a row's
// draws depend only on its logits and its uniforms). temperature 0: the argmax, k times.
at::Tensor draw_tokens(const at::Tensor& logits, double temperature, const at::Tensor& uniform) {
  const int64_t k = uniform.size(1);
  if (temperature == 0.0) return logits.argmax(-1, /*keepdim=*/true).expand({logits.size(0), k}).contiguous();
  at::Tensor probs = at::softmax(logits / temperature, -1);                                      // [n, V]
  at::Tensor ids = at::arange(logits.size(1), logits.options().dtype(at::kLong)).unsqueeze(0);  // [1, V]
  // The first id whose cumulative mass exceeds u; when rounding leaves the total just below u, the last id of
  // nonzero mass (zero-mass ids are flat stretches of the CDF and never chosen).
  at::Tensor last_nonzero = at::where(probs > 0, ids, at::zeros_like(ids)).amax(-1, /*keepdim=*/true);  // [n, 1]
  at::Tensor drawn = at::searchsorted(at::cumsum(probs, -1), uniform, /*out_int32=*/false, /*right=*/true);
  return at::minimum(drawn, last_nonzero);  // [n, k]
}

}  // namespace

bool wants_prompt_scores(const SampleRequest& request) {
  return request.prompt_logprobs || request.topk_prompt_logprobs > 0 || request.prompt_alt_tokens_k > 0 ||
         request.target_prompt_token_ids.defined();
}

void validate_prompt_scoring(SampleRequest& request, int64_t vocab, int64_t max_logprobs_k) {
  const int64_t scored = request.prompt.numel() - 1;
  auto check_k = [&](int64_t k, const char* name) {
    SKYRL_TX_CHECK(k >= 0 && k <= std::min(max_logprobs_k, vocab), InvalidArgument, "sample: ", name,
                   " must be in [0, ", std::min(max_logprobs_k, vocab), "] (got ", k,
                   "); max_logprobs_k in --backend-config sets the upper bound");
  };
  check_k(request.topk_prompt_logprobs, "topk_prompt_logprobs");
  check_k(request.topk_sample_logprobs, "topk_sample_logprobs");
  check_k(request.prompt_alt_tokens_k, "prompt_alt_tokens_k");
  if (request.prompt_logprobs_last_n != 0) {
    SKYRL_TX_CHECK(request.prompt_logprobs || request.topk_prompt_logprobs > 0, InvalidArgument,
                   "sample: prompt_logprobs_last_n applies to prompt logprobs; set prompt_logprobs (or "
                   "topk_prompt_logprobs) too, or leave it unset");
    SKYRL_TX_CHECK(request.prompt_logprobs_last_n >= 1 && request.prompt_logprobs_last_n <= scored, InvalidArgument,
                   "sample: prompt_logprobs_last_n must be in [1, len(prompt) - 1 = ", scored, "] (got ",
                   request.prompt_logprobs_last_n, ")");
  }
  at::Tensor& targets = request.target_prompt_token_ids;
  if (!targets.defined()) return;
  SKYRL_TX_CHECK(targets.dim() == 2 && targets.size(0) == scored && targets.size(1) >= 1, InvalidArgument,
                 "sample: target_prompt_logprobs must have shape [len(prompt) - 1, K] = [", scored,
                 ", K >= 1] (got ", shape_str(targets), ")");
  SKYRL_TX_CHECK(!at::isFloatingType(targets.scalar_type()), InvalidArgument,
                 "sample: target_prompt_logprobs must hold int64 token ids (got ", dtype_name(targets.scalar_type()),
                 ")");
  targets = targets.to(at::kLong).contiguous();
  if (targets.numel() == 0) return;
  const int64_t lo = targets.min().item<int64_t>(), hi = targets.max().item<int64_t>();
  SKYRL_TX_CHECK(lo >= -1 && hi < vocab, InvalidArgument, "sample: target_prompt_logprobs holds token id ",
                 (lo < -1 ? lo : hi), ", outside [0, ", vocab, ") (-1 asks for nothing)");
}

int64_t first_scored_row(const SampleRequest& request) {
  const int64_t scored = request.prompt.numel() - 1;
  int64_t begin = scored;
  if (request.prompt_logprobs || request.topk_prompt_logprobs > 0) {
    begin = std::min(begin, request.prompt_logprobs_last_n > 0 ? scored - request.prompt_logprobs_last_n : 0);
  }
  if (request.prompt_alt_tokens_k > 0) begin = 0;
  if (request.target_prompt_token_ids.defined() && scored > 0) {
    at::Tensor asked_rows = (request.target_prompt_token_ids >= 0).any(1).nonzero();  // [rows asking, 1]
    if (asked_rows.numel() > 0) begin = std::min(begin, asked_rows.min().item<int64_t>());
  }
  return begin;
}

void score_prompt(const models::CausalLM& model, const SampleRequest& request, int64_t slot, const at::Tensor& hidden,
                  int64_t offset, int64_t chunk_tokens, at::Generator& rng, SampleResult& result) {
  const int64_t prompt_len = offset + hidden.size(0), scored = prompt_len - 1;  // row t scores prompt token t + 1
  const int64_t k = request.topk_prompt_logprobs, alt_k = request.prompt_alt_tokens_k;
  const bool wants_logprobs = request.prompt_logprobs || k > 0;
  const bool wants_targets = request.target_prompt_token_ids.defined();
  const at::Device device = hidden.device();
  const at::TensorOptions host_float = at::TensorOptions().dtype(at::kFloat);

  // Outputs on the host, filled where computed: NaN / -1 mark positions not scored.
  at::Tensor logprobs = at::full({prompt_len}, NAN, host_float);           // [P]
  at::Tensor top_ids = at::full({prompt_len, k}, -1, at::kLong);           // [P, k]
  at::Tensor top_logprobs = at::full({prompt_len, k}, NAN, host_float);    // [P, k]
  const int64_t target_cols = wants_targets ? request.target_prompt_token_ids.size(1) : 0;
  at::Tensor target_logprobs = at::zeros({scored, target_cols}, host_float);  // [P - 1, K]
  at::Tensor alt_ids = at::zeros({scored, alt_k}, at::kLong);                 // [P - 1, alt_k]
  at::Tensor alt_logprobs = at::zeros({scored, alt_k}, host_float);           // [P - 1, alt_k]

  // The first row any output needs: prompt_logprobs_last_n alone projects just the last N rows.
  const int64_t logprob_begin = request.prompt_logprobs_last_n > 0 ? scored - request.prompt_logprobs_last_n : 0;
  const int64_t begin = first_scored_row(request);
  SKYRL_TX_INTERNAL_ASSERT(offset <= begin, "score_prompt: rows from ", offset, " given, row ", begin, " needed");
  at::Tensor targets, uniform;
  if (wants_targets && scored > 0) targets = request.target_prompt_token_ids.to(device);  // [P - 1, K]
  // Drawn up front, whole-prompt shaped, so the draws do not depend on the chunk size.
  if (alt_k > 0) uniform = at::rand({scored, alt_k}, rng, host_float);  // [P - 1, alt_k]

  const at::Tensor prompt_targets = request.prompt.to(device);  // [P]
  for (int64_t start = begin; start < scored; start += chunk_tokens) {
    const int64_t length = std::min(chunk_tokens, scored - start), end = start + length;
    at::Tensor logits =
        model.logits(hidden.narrow(0, start - offset, length), lora::AdapterSegments::uniform(slot, length))
            .to(at::kFloat);  // [length, V]
    at::Tensor log_probs = at::log_softmax(logits, -1);     // [length, V]
    const int64_t lo = std::max(start, logprob_begin);      // logprob rows of this chunk: [lo, end)
    if (wants_logprobs && lo < end) {
      at::Tensor rows = log_probs.narrow(0, lo - start, end - lo);  // [n, V]
      at::Tensor picked = rows.gather(1, prompt_targets.narrow(0, lo + 1, end - lo).unsqueeze(1)).squeeze(1);
      logprobs.narrow(0, lo + 1, end - lo).copy_(picked.cpu());
      if (k > 0) {
        auto [values, indices] = rows.topk(k, -1, /*largest=*/true, /*sorted=*/true);  // [n, k]
        top_ids.narrow(0, lo + 1, end - lo).copy_(indices.cpu());
        top_logprobs.narrow(0, lo + 1, end - lo).copy_(values.cpu());
      }
    }
    if (targets.defined()) {
      at::Tensor wanted = targets.narrow(0, start, length);  // [length, K]
      at::Tensor values = log_probs.gather(1, wanted.clamp_min(0));
      target_logprobs.narrow(0, start, length).copy_(at::where(wanted >= 0, values, at::zeros_like(values)).cpu());
    }
    if (alt_k > 0) {
      at::Tensor drawn = draw_tokens(logits, request.params.temperature, uniform.narrow(0, start, length).to(device));
      alt_ids.narrow(0, start, length).copy_(drawn.cpu());
      alt_logprobs.narrow(0, start, length).copy_(log_probs.gather(1, drawn).cpu());
    }
  }
  if (wants_logprobs) result.prompt_logprobs = logprobs;
  if (k > 0) {
    result.topk_prompt_token_ids = top_ids;
    result.topk_prompt_logprobs = top_logprobs;
  }
  if (wants_targets) result.target_prompt_logprobs = target_logprobs;
  if (alt_k > 0) {
    result.prompt_alt_token_ids = alt_ids;
    result.prompt_alt_logprobs = alt_logprobs;
  }
}

}  // namespace skyrl_tx::sampling
