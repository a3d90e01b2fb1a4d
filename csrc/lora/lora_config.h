// LoraConfig: one adapter's rank, alpha, init seed and target module groups (the SDK's LoraConfig).
#pragma once

#include <cstdint>

namespace skyrl_tx::lora {

struct LoraConfig {
  int64_t rank = 32;
  double alpha = 32.0;  // scaling = alpha / rank (Hu et al. 2021, eq. 4)
  uint64_t seed = 0;
  bool train_attn = true;     // q/k/v/o projections
  bool train_mlp = true;      // gate/up/down projections
  bool train_unembed = true;  // lm_head

  double scaling() const { return alpha / static_cast<double>(rank); }
  /// Throws InvalidArgument naming the field (rank out of [1, max_rank], alpha <= 0, no target).
  void validate(int64_t max_rank) const;
};

}  // namespace skyrl_tx::lora
