"""Reading a checkpoint maps its files instead of copying them (safetensors' load_file maps each file privately):
while tensor-parallel ranks load, the page cache holds the model once for all of them, each rank touching only the
rows of its parts before the copy to its device (csrc/models/hf_weights.cpp). Writing into a loaded tensor never
reaches the file. (That the model takes copies, never the mapped pages: WeightStoreTest in tests/cpp.)"""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from skyrl_tx.models.checkpoint import load_weights


def _private_bytes() -> int:
    """This process's anonymous (private) resident memory: a file's mapped pages are not in it, a copy is."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    pytest.skip("no RssAnon in /proc/self/status")


def test_loading_makes_no_private_copy_and_writes_stay_in_this_process(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 1}))
    tensors = {"model.a": torch.arange(24 << 20, dtype=torch.int32).view(-1, 1024),
               "model.b": torch.ones(3, 5, dtype=torch.bfloat16)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    del tensors
    gc.collect()
    before = _private_bytes()
    weights = load_weights(tmp_path)
    int(weights["model.a"].sum())  # every page read
    grown = _private_bytes() - before
    assert grown < 16 << 20, f"{grown / 2**20:.1f} MiB private after reading a 96 MiB tensor: copied, not mapped"
    assert int(weights["model.a"][-1, -1]) == (24 << 20) - 1
    weights["model.b"].fill_(7)  # copy-on-write: this process's page only
    on_disk = load_file(str(tmp_path / "model.safetensors"))["model.b"]
    assert torch.equal(on_disk, torch.ones(3, 5, dtype=torch.bfloat16))

