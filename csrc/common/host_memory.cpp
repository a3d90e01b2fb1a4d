// Host heap policy for CPU compute: freed tensor memory stays in the process for the next step.
#include "common/host_memory.h"

#include <cstdlib>
#include <cstring>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace skyrl_tx {

bool keep_freed_host_memory() {
#if defined(__GLIBC__)
  static const bool applied = [] {
    const char* env = std::getenv("SKYRL_TX_HOST_MALLOC_TUNING");
    if (env != nullptr && std::strcmp(env, "0") == 0) return false;
    // Both or neither: a fixed trim threshold alone turns off glibc's dynamic mmap threshold, and every block from
    // 128 KiB up would be a fresh mmap (180k faults per step of the `cpu` benchmark config's training).
    const int kMmapThreshold = 32 << 20;    // glibc's maximum on 64-bit (HEAP_MAX_SIZE / 2)
    const int kTrimThreshold = 0x7fffffff;  // mallopt takes an int: ~2 GiB
    return mallopt(M_MMAP_THRESHOLD, kMmapThreshold) == 1 && mallopt(M_TRIM_THRESHOLD, kTrimThreshold) == 1;
  }();
  return applied;
#else
  return false;
#endif
}

}  // namespace skyrl_tx
