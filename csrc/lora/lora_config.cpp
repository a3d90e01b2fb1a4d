// Validation of one adapter's LoraConfig against the server's limits.
#include "lora/lora_config.h"

#include "common/errors.h"

namespace skyrl_tx::lora {

void LoraConfig::validate(int64_t max_rank) const {
  SKYRL_TX_CHECK(rank >= 1, InvalidArgument, "create_adapter: lora rank must be >= 1 (got ", rank, ")");
  SKYRL_TX_CHECK(rank <= max_rank, InvalidArgument, "create_adapter: lora rank ", rank, " exceeds max_lora_rank=",
                 max_rank, "; restart the server with a larger max_lora_rank in --backend-config");
  SKYRL_TX_CHECK(alpha > 0, InvalidArgument, "create_adapter: lora alpha must be > 0 (got ", alpha, ")");
  SKYRL_TX_CHECK(train_attn || train_mlp || train_unembed, InvalidArgument,
                 "create_adapter: at least one of train_attn, train_mlp, train_unembed must be true");
}

}  // namespace skyrl_tx::lora
