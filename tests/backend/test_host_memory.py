"""The CPU backend keeps freed heap memory for the next step (csrc/common/host_memory.cpp): a block between glibc's
default 128 KiB mmap threshold and 32 MiB comes from the heap, not from a fresh mmap that a free hands back to the
kernel, and freeing it does not trim the heap; with the policy off (SKYRL_TX_HOST_MALLOC_TUNING=0), glibc's defaults
mmap it. Each side runs in its own process: the policy is process-wide.

Why not count page faults per training step: with glibc's defaults they vary 0-25,000 per step between runs of the
same tiny workload (which freed blocks raise glibc's dynamic threshold depends on the order of frees), so a fault
count compares two samples of noise; where a block is placed is decided by the thresholds alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TIMEOUT_S = 180

# A 16 MiB block right after the backend is made (the policy is applied there), and whether the [heap] mapping holds
# it before and after it is freed.
SCRIPT = """
import json, sys, torch
from skyrl_tx.backend.native import NativeBackend
from skyrl_tx.config import BackendSettings

def in_heap(address):
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith("[heap]"):
            low, high = (int(x, 16) for x in line.split()[0].split("-"))
            if low <= address < high:
                return True
    return False

backend = NativeBackend(sys.argv[1], BackendSettings(max_lora_adapters=1, max_lora_rank=4))
block = torch.empty(4 << 20)  # [4Mi] float32: 16 MiB
address = block.data_ptr()
placed = in_heap(address)
del block
print(json.dumps({"placed_in_heap": placed, "kept_after_free": in_heap(address)}))
"""


def _placement(path: Path, tuning: str) -> dict[str, bool]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SKYRL_TX_HOST_MALLOC_TUNING": tuning}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(path)], env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("tuning", ["1", "0"])
def test_cpu_blocks_stay_in_the_heap_only_with_the_policy(tiny_model_dir, tuning: str) -> None:
    placement = _placement(tiny_model_dir("tiny-qwen3"), tuning)
    if tuning == "1":
        assert placement == {"placed_in_heap": True, "kept_after_free": True}, placement
    else:  # glibc's defaults: mmapped, unmapped at free (the test would pass without the policy otherwise)
        assert placement == {"placed_in_heap": False, "kept_after_free": False}, placement
