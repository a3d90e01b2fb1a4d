"""The CPU backend keeps freed heap memory for the next step (csrc/common/host_memory.cpp): a training step whose
activations exceed glibc's default 128 KiB mmap threshold faults far fewer fresh pages in than with the policy off
(SKYRL_TX_HOST_MALLOC_TUNING=0). Each side runs in its own process: the policy is process-wide."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TIMEOUT_S = 180

# Four warm-up steps (glibc's dynamic threshold settles), then the minor page faults of four more.
SCRIPT = """
import json, resource, sys, torch
from skyrl_tx.backend.native import NativeBackend
from skyrl_tx.config import BackendSettings
from skyrl_tx.types import Datum, TrainRequest
torch.set_num_threads(1)
backend = NativeBackend(sys.argv[1], BackendSettings(max_lora_adapters=1, max_lora_rank=4))
backend.create_model("m", lora_rank=4)
gen = torch.Generator().manual_seed(0)
vocab = backend.decoder_config.vocab_size
rows = [torch.randint(0, vocab, (513,), generator=gen) for _ in range(8)]
request = TrainRequest("m", [Datum(r[:-1], {"target_tokens": r[1:], "weights": torch.ones(512)}) for r in rows])
for _ in range(4):
    backend.forward_backward([request])
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    backend.forward_backward([request])
print(json.dumps({"faults_per_step": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 4}))
"""


def _faults_per_step(path: Path, tuning: str) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SKYRL_TX_HOST_MALLOC_TUNING": tuning}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(path)], env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])["faults_per_step"]


def test_cpu_steps_reuse_freed_pages(tiny_model_dir) -> None:
    path = tiny_model_dir("tiny-qwen3")
    on, off = _faults_per_step(path, "1"), _faults_per_step(path, "0")
    assert off > 1000, f"the workload must fault pages in with glibc's defaults (off: {off:.0f} per step)"
    assert on < off / 4, f"kept freed memory: {on:.0f} faults per step, against {off:.0f} without"
