// Tinker's loss functions: per-token losses summed over tokens, with their inputs and config keys.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace skyrl_tx::loss {

enum class LossKind : int64_t { kCrossEntropy = 0, kImportanceSampling, kPpo, kCispo, kDro };

/// "cross_entropy", "importance_sampling", "ppo", "cispo", "dro"; throws InvalidArgument otherwise.
LossKind parse_loss_kind(const std::string& name);
const char* loss_name(LossKind kind);

/// Scalars from loss_fn_config with Tinker's defaults (ppo 0.8/1.2, cispo 0.0/4.0, dro beta 0.01).
struct LossConfig {
  double clip_low = 0.0;
  double clip_high = 0.0;
  double beta = 0.0;
};

/// Validates config keys for the loss (unknown keys are user errors naming the key) and fills defaults.
LossConfig parse_loss_config(LossKind kind, const std::map<std::string, double>& config);

/// loss_fn_inputs keys: required and optional ones (target_tokens included) for a loss.
const std::vector<std::string>& required_inputs(LossKind kind);
const std::vector<std::string>& optional_inputs(LossKind kind);

/// Per-token inputs of a packed micro-batch; every tensor is [N] over the flattened tokens.
struct LossInputs {
  at::Tensor kind;        // int64, LossKind per token (padding: any; masked by `valid`)
  at::Tensor valid;       // bool
  at::Tensor weights;     // float32 (1 where the loss has no weights input)
  at::Tensor sampling_logprobs;  // float32 (q)
  at::Tensor advantages;  // float32 (A)
  at::Tensor clip_low;    // float32
  at::Tensor clip_high;   // float32
  at::Tensor beta;        // float32
};

/// Per-token loss for target logprobs `lp` [N] (float32, may require grad); 0 on invalid tokens.
///   cross_entropy:        -lp·w
///   importance_sampling:  -r·A·w,  r = exp(lp − q)
///   ppo:                  -min(r·A, clip(r, lo, hi)·A)·w        (Schulman et al. 2017)
///   cispo:                -sg(clip(r, lo, hi))·lp·A·w            (MiniMax-M1, 2025)
///   dro:                  -(lp·A − ½·β·(lp − q)²)·w              (Richemond et al. 2024)
at::Tensor elementwise_loss(const at::Tensor& lp, const LossInputs& in);

}  // namespace skyrl_tx::loss
