// Test-build-only fault injection: makes a chosen training micro-batch fail after its backward ran.
#include "backend/fault_injection.h"

#ifdef SKYRL_TX_TESTING
#include <atomic>

#include "common/errors.h"

namespace skyrl_tx::backend::fault_injection {
namespace {
std::atomic<int64_t> armed_micro_batch{-1};
}  // namespace

int64_t fail_micro_batch(int64_t k) { return armed_micro_batch.exchange(k < 0 ? -1 : k); }

void after_micro_batch(int64_t index) {
  int64_t expected = index;
  if (armed_micro_batch.compare_exchange_strong(expected, -1)) {
    throw ResourceExhausted(str_cat("injected failure (test build): training micro-batch ", index,
                                    " failed after its backward"));
  }
}

}  // namespace skyrl_tx::backend::fault_injection
#endif
