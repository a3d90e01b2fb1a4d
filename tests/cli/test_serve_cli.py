"""The server command loads a preset and reports readiness; bad --backend-config stops with the valid keys."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from skyrl_tx.config import BackendSettings
from skyrl_tx.errors import InvalidArgumentError

REPO = Path(__file__).resolve().parents[2]


def run_module(args: list[str], cache: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SKYRL_TX_CACHE_DIR": str(cache)}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=300, cwd=REPO)


def test_api_module_loads_preset_and_reports_ready(preset_cache: Path) -> None:
    result = run_module(["-m", "skyrl_tx.api", "--base-model", "tiny-llama3",
                         "--backend-config", '{"max_lora_adapters": 2}'], preset_cache)
    assert result.returncode == 0, result.stderr
    assert "model loaded: LlamaForCausalLM" in result.stderr
    assert "ready: core loaded with 2 LoRA slots" in result.stderr


def test_unknown_backend_config_key_lists_valid_keys(preset_cache: Path) -> None:
    result = run_module(["-m", "skyrl_tx.api", "--base-model", "tiny-qwen3",
                         "--backend-config", '{"max_lora_adaptors": 2}'], preset_cache)
    assert result.returncode == 2
    assert "unknown key(s) max_lora_adaptors" in result.stderr and "max_lora_adapters" in result.stderr


def test_unknown_base_model_is_a_clear_error(preset_cache: Path) -> None:
    result = run_module(["-m", "skyrl_tx.api", "--base-model", "no-such-model"], preset_cache)
    assert result.returncode == 2
    assert "'no-such-model' is not a preset, a local directory or a hub id" in result.stderr


def test_example_core_logprobs_runs(preset_cache: Path) -> None:
    result = run_module(["examples/core_logprobs.py", "--base-model", "tiny-qwen3"], preset_cache)
    assert result.returncode == 0, result.stderr
    assert "total logprob base=" in result.stdout


@pytest.mark.parametrize(("text", "fragment"), [
    ('{"dtype": "float16"}', "dtype must be 'float32' or 'bfloat16'"),
    ('{"max_lora_rank": 0}', "max_lora_rank must be >= 1"),
    ('{"max_lora_rank": "8"}', "max_lora_rank must be of type int"),
    ("[1, 2]", "must be a JSON object"),
    ("{not json", "not valid JSON"),
])
def test_backend_settings_reject_bad_values(text: str, fragment: str) -> None:
    with pytest.raises(InvalidArgumentError, match=fragment.replace("(", r"\(")):
        BackendSettings.from_json(text)


def test_backend_settings_accept_documented_keys() -> None:
    settings = BackendSettings.from_json('{"max_lora_adapters": 3, "dtype": "bfloat16", "device": "cuda:1"}')
    assert (settings.max_lora_adapters, settings.dtype, settings.device) == (3, "bfloat16", "cuda:1")
