// Host heap policy for CPU compute: freed tensor memory stays in the process for the next step.
#pragma once

namespace skyrl_tx {

/// On glibc: blocks up to 32 MiB (the most glibc allows) come from the heap instead of fresh mmaps, and freed heap
/// memory up to 2 GiB is kept instead of being returned to the OS. A CPU training step allocates and frees the same
/// activation sizes every step; by default glibc hands the larger ones back and the next step faults every page in
/// again (kernel zeroing: 9k-27k page faults and 30-70 ms of system time per step of the `cpu` benchmark config,
/// about 1k and 5-14 ms with this). The cost: the process keeps its peak heap between steps.
/// Process-wide and idempotent; `SKYRL_TX_HOST_MALLOC_TUNING=0` opts out. Returns whether the policy is in force.
bool keep_freed_host_memory();

}  // namespace skyrl_tx
