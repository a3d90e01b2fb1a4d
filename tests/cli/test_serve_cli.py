"""The server command serves a preset and logs readiness; bad --backend-config stops with the valid keys."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from skyrl_tx.config import BackendSettings
from skyrl_tx.errors import InvalidArgumentError

REPO = Path(__file__).resolve().parents[2]


def run_module(args: list[str], cache: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SKYRL_TX_CACHE_DIR": str(cache)}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=300, cwd=REPO)


def test_api_module_serves_and_logs_readiness(preset_cache: Path) -> None:
    from live_server import live_server

    with live_server(base_model="tiny-llama3", backend_config={"max_lora_adapters": 2}) as url:
        log = url.log_tail(200)
        with urllib.request.urlopen(f"{url}/api/v1/get_server_capabilities", timeout=10) as response:
            capabilities = json.loads(response.read())
    assert "model loaded: LlamaForCausalLM" in log and "listening on http://127.0.0.1:" in log
    assert "engine ready (process, pid " in log and "): serving tiny-llama3" in log
    assert capabilities["supported_models"][0]["model_name"] == "tiny-llama3"


def test_unknown_backend_config_key_lists_valid_keys(preset_cache: Path) -> None:
    result = run_module(["-m", "skyrl_tx.api", "--base-model", "tiny-qwen3",
                         "--backend-config", '{"max_lora_adaptors": 2}'], preset_cache)
    assert result.returncode == 2
    assert "unknown key(s) max_lora_adaptors" in result.stderr and "max_lora_adapters" in result.stderr


@pytest.mark.parametrize("value", ["0", "51", "soon"])
def test_a_long_poll_outside_its_range_is_refused_with_the_range(preset_cache: Path, value: str, capsys) -> None:
    from skyrl_tx.cli import build_parser, server_settings

    with pytest.raises(SystemExit) as stopped:
        build_parser().parse_args(["serve", "--base-model", "tiny-qwen3", "--long-poll-s", value])
    assert stopped.value.code == 2
    error = capsys.readouterr().err
    assert "--long-poll-s" in error and ("between 0.5 and 50 seconds" in error or "must be a number" in error), error
    args = build_parser().parse_args(["serve", "--base-model", "tiny-qwen3", "--long-poll-s", "2.5"])
    assert server_settings(args).long_poll_s == 2.5  # and a value in range reaches the server's settings


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
    ('{"generator.inference_engine.tensor_parallel_size": 0}', "inference_engine_tensor_parallel_size"),
    ('{"tensor_parallel_size": 2, "expert_parallel_size": 3}', "expert_parallel_size must be 1, tensor_parallel_size"),
    # over the data-parallel ranks: all of them (no expert groups inside data parallelism), tensor_parallel_size 1
    ('{"fully_sharded_data_parallel_size": 4, "expert_parallel_size": 2}', "fully_sharded_data_parallel_size (4;"),
    ('{"fully_sharded_data_parallel_size": 2, "tensor_parallel_size": 2, "expert_parallel_size": 4}',
     "with tensor_parallel_size 1"),
    ('{"generator.inference_engine.gpu_memory_utilization": 0.8}', "on a CPU give kv_cache_tokens"),
    ('{"colocate_all": false, "trainer.placement.colocate_all": false}', "give it once"),
    ('{"inference_engine_timeout_s": 0.0}', "inference_engine_timeout_s must be > 0"),
    ('{"grouped_expert_gemm": "yes"}', 'grouped_expert_gemm must be "auto", "always" or "never"'),
])
def test_backend_settings_reject_bad_values(text: str, fragment: str) -> None:
    with pytest.raises(InvalidArgumentError, match=fragment.replace("(", r"\(")):
        BackendSettings.from_json(text)


def test_backend_settings_accept_documented_keys() -> None:
    settings = BackendSettings.from_json('{"max_lora_adapters": 3, "dtype": "bfloat16", "device": "cuda:1"}')
    assert (settings.max_lora_adapters, settings.dtype, settings.device) == (3, "bfloat16", "cuda:1")


def test_backend_settings_accept_the_seed_placement_keys_as_written() -> None:
    settings = BackendSettings.from_json('{"trainer.placement.colocate_all": false, '
                                         '"generator.inference_engine.num_engines": 4, '
                                         '"generator.inference_engine.tensor_parallel_size": 1}')
    assert (settings.colocate_all, settings.num_inference_engines, settings.inference_engine_tensor_parallel_size) \
        == (False, 4, 1)
    seed_readme = BackendSettings.from_json('{"trainer.placement.policy_num_gpus_per_node": 4, '
                                            '"generator.inference_engine.num_engines": 4}')
    assert (seed_readme.fully_sharded_data_parallel_size, seed_readme.colocate_all) == (4, True)


def test_backend_settings_accept_the_seed_readme_examples_as_written() -> None:
    """The seed README's multi-node example, key for key: every key means what it says there."""
    settings = BackendSettings.from_json('{"max_lora_adapters": 3, "max_lora_rank": 1, "tensor_parallel_size": 4, '
                                         '"fully_sharded_data_parallel_size": 2, "train_micro_batch_size": 8, '
                                         '"sample_max_num_sequences": 256, "coordinator_address": "node0:7777", '
                                         '"num_processes": 2}')
    assert (settings.max_lora_adapters, settings.max_lora_rank, settings.tensor_parallel_size,
            settings.fully_sharded_data_parallel_size, settings.train_micro_batch_size,
            settings.max_sampling_sequences, settings.coordinator_address, settings.num_processes) == \
        (3, 1, 4, 2, 8, 256, "node0:7777", 2)
    for bad, field in (('{"tensor_parallel_size": 0}', "tensor_parallel_size"),
                       ('{"train_micro_batch_size": -1}', "train_micro_batch_size"),
                       ('{"sample_max_num_sequences": 0}', "max_sampling_sequences"),
                       ('{"sample_max_num_sequences": 8, "max_sampling_sequences": 8}', "sample_max_num_sequences")):
        with pytest.raises(InvalidArgumentError, match=field):
            BackendSettings.from_json(bad)
