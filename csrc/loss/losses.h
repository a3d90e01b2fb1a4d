// Tinker's loss functions: per-token losses summed over tokens, with their inputs and config keys.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "loss/custom_loss.h"

namespace skyrl_tx::loss {

// New kinds go last: the values are stored per token in LossInputs::kind.
enum class LossKind : int64_t {
  kCrossEntropy = 0, kImportanceSampling, kPpo, kCispo, kDro, kGspo, kStableReinforce, kCustom
};

/// "cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce", "custom" (a graph
/// from create_custom_loss, loss/custom_loss.h);
/// throws InvalidArgument otherwise.
LossKind parse_loss_kind(const std::string& name);
const char* loss_name(LossKind kind);

/// Scalars from loss_fn_config with Tinker's defaults (ppo and gspo 0.8/1.2, cispo 0.0/4.0, dro beta 0.01,
/// stable_reinforce kl_coeff 0.01).
struct LossConfig {
  double clip_low = 0.0;
  double clip_high = 0.0;
  double beta = 0.0;  // the loss's penalty coefficient: dro's `beta`, stable_reinforce's `kl_coeff`
};

/// Validates config keys for the loss (unknown keys are user errors naming the key) and fills defaults.
LossConfig parse_loss_config(LossKind kind, const std::map<std::string, double>& config);

/// loss_fn_inputs keys: required and optional ones (target_tokens included) for a loss.
const std::vector<std::string>& required_inputs(LossKind kind);
const std::vector<std::string>& optional_inputs(LossKind kind);

/// A custom-loss datum of a packed micro-batch: its tokens [begin, begin + length) of the flat [N], its graph and
/// its loss_fn_inputs in the graph's order (logprobs excluded: the runner supplies them).
struct CustomLossRow {
  int64_t begin = 0, length = 0;
  size_t batch_row = 0;  // its index among the micro-batch's rows
  const CustomLoss* loss = nullptr;
  std::vector<at::Tensor> inputs;
};

/// Per-token inputs of a packed micro-batch; every tensor is [N] over the flattened tokens.
struct LossInputs {
  at::Tensor kind;        // int64, LossKind per token (padding: any; masked by `valid`)
  at::Tensor valid;       // bool
  at::Tensor weights;     // float32 (1 where the loss has no weights input)
  at::Tensor sampling_logprobs;  // float32 (q)
  at::Tensor advantages;  // float32 (A)
  at::Tensor clip_low;    // float32
  at::Tensor clip_high;   // float32
  at::Tensor beta;        // float32 (dro: beta; stable_reinforce: kl_coeff)
  at::Tensor ratio_mask;  // float32, nonzero on the tokens a gspo datum's sequence ratio averages over
  /// float32, each token's datum's detached gspo sequence log-ratio (see sequence_log_ratio); 0 elsewhere.
  /// Undefined means 0, which is right only for batches without gspo rows.
  at::Tensor seq_log_ratio;
  bool has_sequence_losses = false;  // some row is gspo, so seq_log_ratio must be filled before the loss
  /// float32, d(custom loss)/d lp of every custom-loss token, filled by the micro-batch runner from a no-grad
  /// pre-pass (loss/custom_loss.h); 0 elsewhere; undefined where no row is custom.
  at::Tensor custom_grad;
  std::vector<CustomLossRow> custom_rows;  // whole rows, so they are not sliced with the chunks
};

/// Per-token loss for target logprobs `lp` [N] (float32, may require grad); 0 on invalid tokens.
///   cross_entropy:        -lp·w
///   importance_sampling:  -r·A·w,  r = exp(lp − q)
///   ppo:                  -min(r·A, clip(r, lo, hi)·A)·w        (Schulman et al. 2017)
///   cispo:                -sg(clip(r, lo, hi))·lp·A·w            (MiniMax-M1, 2025)
///   dro:                  -(lp·A − ½·β·(lp − q)²)·w              (Richemond et al. 2024)
///   gspo:                 -min(s_t·A, clip(s_t, lo, hi)·A)·w,  s_t = exp(sg(S) + lp − sg(lp))  (GSPO-token)
///   stable_reinforce:     (-A·lp + κ·(r − 1 − (lp − q)))·w       (REINFORCE + sampler KL, κ = kl_coeff)
///   custom:               g·lp, g = sg(dC/dlp) of the datum's custom loss C: the gradient of C, in the same pass
/// S is the datum's sequence log-ratio, in.seq_log_ratio; sources and readings are at the top of losses.cpp.
at::Tensor elementwise_loss(const at::Tensor& lp, const LossInputs& in);

/// GSPO's per-datum sequence log-ratio S = mean over the datum's ratio_mask tokens of (lp − q), detached, and
/// copied onto every token of the datum: [N] float32 (0 for data whose mask is empty, e.g. non-gspo rows).
/// token_datum: int64 [N], the datum (in [0, num_data)) each token belongs to (batching::PackedBatch::token_request;
/// padding may name any datum: `valid` keeps it out).
at::Tensor sequence_log_ratio(const at::Tensor& lp, const LossInputs& in, const at::Tensor& token_datum,
                              int64_t num_data);

}  // namespace skyrl_tx::loss
