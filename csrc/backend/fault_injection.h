// Test-build-only fault injection: makes a chosen training micro-batch fail after its backward ran.
#pragma once

#include <cstdint>

namespace skyrl_tx::backend::fault_injection {

#ifdef SKYRL_TX_TESTING
/// Arms a one-shot failure: in the next forward/forward_backward call, micro-batch `k` (0-based, in run
/// order) throws ResourceExhausted after its forward and backward ran, as a device running out of memory
/// there would. k < 0 disarms. Returns what was armed before (-1: nothing, or the failure already fired).
/// Only test builds (SKYRL_TX_BUILD_TESTS=ON) have it.
int64_t fail_micro_batch(int64_t k);
/// Throws (and disarms) when armed for micro-batch `index`.
void after_micro_batch(int64_t index);
#else
inline void after_micro_batch(int64_t) {}
#endif

}  // namespace skyrl_tx::backend::fault_injection
