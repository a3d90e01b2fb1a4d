"""Qwen3-0.6B as published (every width: vocab 151,936, head_dim 128, GQA 16/8, tied embeddings; sharded
safetensors + index in bf16), cut to 2 layers, through the real SDK against a live server: load, LoRA step, sample,
save, export (PEFT and merged, read back by transformers + PEFT), reload; the engine's peak memory against the plan."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tinker
import torch
from live_server import live_server
from sdk_training import download, token_datum
from tinker import types

from skyrl_tx.config import BackendSettings
from skyrl_tx.models.hf_config import load_decoder_config
from skyrl_tx.models.published_checkpoint import reduced_model_dir
from skyrl_tx.plan.memory import plan_memory

NAME = "Qwen/Qwen3-0.6B"
CONFIG = {"dtype": "bfloat16", "max_lora_adapters": 2, "max_lora_rank": 8, "max_resident_snapshots": 1,
          "max_full_models": 0, "max_sampling_sequences": 4, "max_sampling_length": 128,
          "train_micro_batch_tokens": 256, "logprobs_chunk_tokens": 128}
TOKENS = [5, 17, 300, 42, 7, 99, 1000, 12, 64, 128, 256, 3, 9, 27, 81, 243, 11, 1500, 33, 8]
PLAN_TOLERANCE = 0.15
BF16_MEAN_ERROR = 0.05  # mean |difference| of logprobs near -12 computed in bf16 (2^-8 relative) vs float32


@pytest.fixture(scope="module")
def model_dir(preset_cache) -> Path:
    return reduced_model_dir(NAME, num_layers=2)


@pytest.fixture(scope="module")
def server(model_dir: Path):
    with live_server(base_model=str(model_dir), aliases=[NAME], backend_config=CONFIG) as url:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("TINKER_BASE_URL", url)
            mp.setenv("TINKER_API_KEY", "tml-test")
            mp.setenv("TINKER_TELEMETRY", "0")
            yield url


def _engine_peak_bytes(url: str) -> int:
    import urllib.request

    with urllib.request.urlopen(f"{url}/api/v1/healthz", timeout=10) as response:
        pid = json.loads(response.read())["engine_pid"]
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/PID/status")


def _logprobs(client, tokens: list[int]) -> torch.Tensor:
    out = client.forward([token_datum(tokens)], "cross_entropy").result()
    return torch.tensor(out.loss_fn_outputs[0]["logprobs"].tolist())


def test_checkpoint_has_the_hub_layout(model_dir: Path) -> None:
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded, as the hub's larger checkpoints are
    assert "model.layers.1.self_attn.q_norm.weight" in index["weight_map"]
    config = load_decoder_config(model_dir)
    assert (config.vocab_size, config.head_dim, config.num_attention_heads, config.num_key_value_heads) == \
        (151936, 128, 16, 8)


def test_lora_step_sample_save_export_reload_and_peak_within_plan(server, model_dir: Path, tmp_path: Path) -> None:
    from hf_reference import hf_token_logprobs, load_hf_model
    from peft import PeftModel

    service = tinker.ServiceClient()
    client = service.create_lora_training_client(base_model=NAME, rank=8, seed=1).result()
    before = _logprobs(client, TOKENS)
    assert before.shape == (len(TOKENS) - 1,)
    for _ in range(2):
        result = client.forward_backward([token_datum(TOKENS)], "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=1e-4)).result()
        assert np.isfinite(np.asarray(result.loss_fn_outputs[0]["logprobs"].tolist())).all()
    after = _logprobs(client, TOKENS)
    assert after.sum() > before.sum()  # the step trained the adapter on these tokens
    assert (after - before).abs().mean() > 3 * BF16_MEAN_ERROR  # by more than the exports may differ below

    sampler = client.save_weights_and_get_sampling_client().result()
    sample = sampler.sample(prompt=types.ModelInput.from_ints(TOKENS[:8]), num_samples=2,
                            sampling_params=types.SamplingParams(max_tokens=6, temperature=0.0)).result()
    assert [len(s.tokens) for s in sample.sequences] == [6, 6]

    path = client.save_state("real-shape").result().path
    reloaded = service.create_training_client_from_state(path).result()
    torch.testing.assert_close(_logprobs(reloaded, TOKENS), after, atol=0, rtol=0)

    rest = tinker.RestClient(base_url=server)
    adapter = download(rest.get_external_weights_urls(client.save_weights_external("peft").result().path)
                       .result().urls, tmp_path / "adapter")
    peft_model = PeftModel.from_pretrained(load_hf_model(model_dir), str(adapter)).eval()
    # the server computes in bf16; transformers here in float32 from the same bf16 weights
    assert (hf_token_logprobs(peft_model, TOKENS) - after).abs().mean() < BF16_MEAN_ERROR
    from skyrl_tx.checkpoints.merge import merge_adapter

    merge_adapter(model_dir, adapter, tmp_path / "merged")
    assert (hf_token_logprobs(load_hf_model(tmp_path / "merged"), TOKENS) - after).abs().mean() < BF16_MEAN_ERROR

    planned = plan_memory(load_decoder_config(model_dir), BackendSettings.from_dict(CONFIG)).devices[0].total
    measured = _engine_peak_bytes(server)
    print(f"\nreal-shape {NAME} (2 layers, bf16): engine peak {measured / 2**30:.3f} GiB, plan {planned / 2**30:.3f} "
          f"GiB, plan/measured {planned / measured:.3f}")
    assert abs(planned - measured) <= PLAN_TOLERANCE * measured
