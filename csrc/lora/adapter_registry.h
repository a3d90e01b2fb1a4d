// AdapterRegistry: maps adapter ids to slots 1..max_adapters with a free list; slot 0 is the base model.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "lora/lora_config.h"

namespace skyrl_tx::lora {

class AdapterRegistry {
 public:
  explicit AdapterRegistry(int64_t max_adapters);

  /// Reserves the lowest free slot. Throws Conflict if the id exists, ResourceExhausted if full.
  int64_t allocate(const std::string& adapter_id, const LoraConfig& config);
  /// Frees the slot; returns it. Throws NotFound for an unknown id.
  int64_t release(const std::string& adapter_id);
  /// "" means the base model (slot 0). Throws NotFound for an unknown id.
  int64_t slot_of(const std::string& adapter_id) const;
  const LoraConfig& config_of(const std::string& adapter_id) const;
  bool contains(const std::string& adapter_id) const { return slots_.count(adapter_id) > 0; }
  int64_t num_slots() const { return max_adapters_ + 1; }
  int64_t num_active() const { return static_cast<int64_t>(slots_.size()); }

 private:
  int64_t max_adapters_;
  std::map<std::string, int64_t> slots_;
  std::map<std::string, LoraConfig> configs_;
  std::vector<int64_t> free_slots_;  // kept sorted descending so back() is the lowest
};

}  // namespace skyrl_tx::lora
