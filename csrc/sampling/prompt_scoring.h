// score_prompt: what a prefill computes over a prompt's own positions besides the KV cache: the prompt tokens'
// logprobs (all or the last N), the top k at each position, the logprobs of requested target ids, and k
// alternative draws per position — all from one pass over [chunk, vocab] logits.
#pragma once

#include <ATen/ATen.h>

#include "models/causal_lm.h"
#include "sampling/sampling_params.h"

namespace skyrl_tx::sampling {

/// True when the request asks for anything score_prompt computes.
bool wants_prompt_scores(const SampleRequest& request);

/// Throws InvalidArgument naming the field when the prompt-scoring options are out of range: k's above
/// `max_logprobs_k`, prompt_logprobs_last_n outside [1, P - 1] or without prompt logprobs, target ids that are
/// not [P - 1, K] int64 in [-1, vocab). Normalises target ids to contiguous int64.
void validate_prompt_scoring(SampleRequest& request, int64_t vocab, int64_t max_logprobs_k);

/// The first prompt row (row t predicts token t + 1) whose hidden state some requested output needs; P - 1 (only the
/// last row, whose logits start sampling) when the request scores nothing. A prefix cache may serve rows before it.
int64_t first_scored_row(const SampleRequest& request);

/// hidden: [P - offset, hidden], the final hidden states of prompt rows [offset, P) (row t predicts prompt token
/// t + 1) under adapter `slot`; offset <= first_scored_row (rows before it come from a prefix cache).
/// Fills the result fields the request asks for. Only [chunk_tokens, vocab] logits exist at once, and only the
/// rows some output needs are projected (with prompt_logprobs_last_n alone, just the last N).
/// `rng` draws the alternative tokens (CPU generator: the same draws on any device).
void score_prompt(const models::CausalLM& model, const SampleRequest& request, int64_t slot, const at::Tensor& hidden,
                  int64_t offset, int64_t chunk_tokens, at::Generator& rng, SampleResult& result);

}  // namespace skyrl_tx::sampling
