"""The API process never loads torch or the extension: importing the app and resolving a cached base model, as
`skyrl-tx serve` does, leaves both out of sys.modules (checked in a fresh interpreter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

PROBE = """
import json, sys
import skyrl_tx, skyrl_tx.api.app, skyrl_tx.api.__main__
from skyrl_tx.models.checkpoint import resolve_model_path
from skyrl_tx.models.hf_config import load_decoder_config
load_decoder_config(resolve_model_path(sys.argv[1]))
print(json.dumps(sorted(m for m in sys.modules if m == "torch" or m.startswith(("torch.", "skyrl_tx._C")))))
"""


def loaded_modules(model: str, env: dict[str, str]) -> list[str]:
    proc = subprocess.run([sys.executable, "-c", PROBE, model], env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_importing_the_api_and_resolving_the_model_loads_no_torch(tiny_model_dir, preset_cache: Path) -> None:
    model_dir = tiny_model_dir("tiny-qwen3")  # generated here first: generating a preset needs torch
    env = {**os.environ, "SKYRL_TX_CACHE_DIR": str(preset_cache), "OMP_NUM_THREADS": "1"}
    assert loaded_modules("tiny-qwen3", env) == []
    assert loaded_modules(str(model_dir), env) == []


def test_the_probe_sees_torch_when_it_is_loaded(preset_cache: Path) -> None:
    """The check above can fail: the same probe reports torch once the extension is loaded."""
    env = {**os.environ, "SKYRL_TX_CACHE_DIR": str(preset_cache), "OMP_NUM_THREADS": "1"}
    probe = PROBE.replace("import json, sys", "import json, sys\nfrom skyrl_tx._ext import load_extension\n"
                          "load_extension()")
    proc = subprocess.run([sys.executable, "-c", probe, "tiny-qwen3"], env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "torch" in loaded and "skyrl_tx._C" in loaded
