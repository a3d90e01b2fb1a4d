"""Reading a checkpoint maps its files instead of copying them (safetensors' load_file maps each file privately):
while tensor-parallel ranks load, the page cache holds the model once for all of them, each rank touching only the
rows of its parts before the copy to its device (csrc/models/hf_weights.cpp). Writing into a loaded tensor never
reaches the file. (That the model takes copies, never the mapped pages: WeightStoreTest in tests/cpp.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

# Run in a fresh interpreter: RssAnon is the whole process's, and a long test session's other threads (servers' and
# SDK clients' leftovers) allocate while it is measured; once a CI run saw 96 MiB here that a fresh process never does.
MEASURE = """
import gc, json, sys
from pathlib import Path
import torch
from skyrl_tx.models.checkpoint import load_weights

def private_bytes():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return None

gc.collect()
before = private_bytes()
weights = load_weights(Path(sys.argv[1]))
last = int(weights["model.a"].sum())  # every page read
grown = None if before is None else private_bytes() - before
weights["model.b"].fill_(7)  # copy-on-write: this process's page only
print(json.dumps({"grown": grown, "last": int(weights["model.a"][-1, -1]), "sum": last}))
"""


def test_loading_makes_no_private_copy_and_writes_stay_in_this_process(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 1}))
    n = 24 << 20
    tensors = {"model.a": torch.arange(n, dtype=torch.int32).view(-1, 1024),
               "model.b": torch.ones(3, 5, dtype=torch.bfloat16)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    del tensors
    result = subprocess.run([sys.executable, "-c", MEASURE, str(tmp_path)], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(result.stdout.strip().splitlines()[-1])
    if got["grown"] is None:
        pytest.skip("no RssAnon in /proc/self/status")
    assert got["grown"] < 16 << 20, f"{got['grown'] / 2**20:.1f} MiB private after reading a 96 MiB tensor: copied"
    assert got["last"] == n - 1 and got["sum"] == n * (n - 1) // 2
    on_disk = load_file(str(tmp_path / "model.safetensors"))["model.b"]  # the child's write never reached the file
    assert torch.equal(on_disk, torch.ones(3, 5, dtype=torch.bfloat16))
