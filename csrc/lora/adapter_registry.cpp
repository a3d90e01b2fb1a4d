// AdapterRegistry: maps adapter ids to slots 1..max_adapters with a free list; slot 0 is the base model.
#include "lora/adapter_registry.h"

#include <algorithm>
#include <functional>

#include "common/errors.h"

namespace skyrl_tx::lora {

AdapterRegistry::AdapterRegistry(int64_t max_adapters) : max_adapters_(max_adapters) {
  SKYRL_TX_CHECK(max_adapters >= 1, InvalidArgument, "max_lora_adapters must be >= 1 (got ", max_adapters, ")");
  for (int64_t slot = max_adapters; slot >= 1; --slot) free_slots_.push_back(slot);
}

int64_t AdapterRegistry::allocate(const std::string& adapter_id, const LoraConfig& config) {
  SKYRL_TX_CHECK(!adapter_id.empty(), InvalidArgument, "create_adapter: adapter id must not be empty");
  SKYRL_TX_CHECK(!contains(adapter_id), Conflict, "create_adapter: adapter '", adapter_id, "' already exists");
  SKYRL_TX_CHECK(!free_slots_.empty(), ResourceExhausted, "create_adapter: all ", max_adapters_,
                 " adapter slots are in use; unload a model or raise max_lora_adapters in --backend-config");
  const int64_t slot = free_slots_.back();
  free_slots_.pop_back();
  slots_[adapter_id] = slot;
  configs_[adapter_id] = config;
  return slot;
}

int64_t AdapterRegistry::release(const std::string& adapter_id) {
  const int64_t slot = slot_of(adapter_id);
  SKYRL_TX_CHECK(slot != 0, InvalidArgument, "remove_adapter: the base model cannot be removed");
  slots_.erase(adapter_id);
  configs_.erase(adapter_id);
  free_slots_.push_back(slot);
  std::sort(free_slots_.begin(), free_slots_.end(), std::greater<>());
  return slot;
}

int64_t AdapterRegistry::slot_of(const std::string& adapter_id) const {
  if (adapter_id.empty()) return 0;
  auto it = slots_.find(adapter_id);
  SKYRL_TX_CHECK(it != slots_.end(), NotFound, "adapter '", adapter_id, "' not found; create it first");
  return it->second;
}

const LoraConfig& AdapterRegistry::config_of(const std::string& adapter_id) const {
  auto it = configs_.find(adapter_id);
  SKYRL_TX_CHECK(it != configs_.end(), NotFound, "adapter '", adapter_id, "' not found; create it first");
  return it->second;
}

}  // namespace skyrl_tx::lora
