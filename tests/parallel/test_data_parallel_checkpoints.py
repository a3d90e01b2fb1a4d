"""Checkpoints move between layouts, through the real SDK: a full fine-tune saved (weights + AdamW state) by a
one-process server resumes on a 2-rank data-parallel server, whose ranks each keep their ZeRO range of the loaded
moments, and one saved there (the ranges gathered into whole tensors) resumes on a one-process server; a LoRA adapter
does the same through a tensor-parallel server (each rank keeping its part of the factors and moments), and a full
fine-tune through TP alone and DP x TP (ZeRO ranges of each rank's parts); every resumed run's losses equal the run
that saved the checkpoint and went on."""

from __future__ import annotations

import os

import pytest
import sdk_training
from live_server import live_server
from tinker import types

ADAM = types.AdamParams(learning_rate=1e-3)
DP = {"fully_sharded_data_parallel_size": 2, "max_full_models": 2}
TP = {"tensor_parallel_size": 2, "max_full_models": 2}
DP_TP = {**DP, **TP}  # 4 ranks: each part's ZeRO ranges over its 2 replicas
ONE = {"max_full_models": 2}
STEPS = 2


def _steps(client, first: int) -> list[float]:
    return [sdk_training.train_step(client, first + k, ADAM) for k in range(STEPS)]


def _session(url) -> object:
    import tinker

    os.environ.update(TINKER_BASE_URL=url, TINKER_API_KEY="tml-dp", TINKER_TELEMETRY="0")
    return tinker.ServiceClient()


@pytest.mark.parametrize("lora_rank,layout", [(0, DP), (4, TP), (0, TP), (0, DP_TP)],
                         ids=["full-dp2", "lora-tp2", "full-tp2", "full-dp2-tp2"])
def test_a_model_resumes_across_layouts(preset_cache, tmp_path, lora_rank: int, layout: dict) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    with live_server(data_dir=data_dir, backend_config=ONE) as url, _session(url) as service:
        client = service.create_lora_training_client(base_model="tiny-qwen3", rank=lora_rank, seed=3).result()
        _steps(client, 0)
        from_one = client.save_state("from_one").result().path
        after_one = _steps(client, 10)  # what the one-process run does next
    with live_server(data_dir=data_dir, backend_config=layout) as url, _session(url) as service:
        ranks = layout.get("fully_sharded_data_parallel_size", 1) * layout.get("tensor_parallel_size", 1)
        assert f"parallel: {ranks} ranks" in url.log_tail(), url.log_tail()
        resumed = service.create_training_client_from_state_with_optimizer(from_one).result()
        assert _steps(resumed, 10) == pytest.approx(after_one, rel=1e-5, abs=1e-5)
        from_dp = resumed.save_state("from_dp").result().path
        after_dp = _steps(resumed, 20)  # what the 2-rank run does next
        sampler = resumed.save_weights_and_get_sampling_client().result()  # its sampler weights, whole
        prompt, greedy = types.ModelInput.from_ints([5, 6, 7, 8]), types.SamplingParams(max_tokens=8, temperature=0.0)
        sampled_dp = list(sampler.sample(prompt, 1, greedy).result().sequences[0].tokens)
        sampler_path = resumed.save_weights_for_sampler("for_one").result().path
    with live_server(data_dir=data_dir, backend_config=ONE) as url, _session(url) as service:
        resumed = service.create_training_client_from_state_with_optimizer(from_dp).result()
        assert _steps(resumed, 20) == pytest.approx(after_dp, rel=1e-5, abs=1e-5)
        # The parallel layout's sampler weights, loaded by one process, sample the same tokens.
        sampler = service.create_sampling_client(model_path=sampler_path)
        assert list(sampler.sample(prompt, 1, greedy).result().sequences[0].tokens) == sampled_dp
        # Without the optimizer state the trajectory differs: the moments were really carried over.
        weights_only = service.create_training_client_from_state(from_dp).result()
        assert abs(_steps(weights_only, 20)[-1] - after_dp[-1]) > 1e-4
