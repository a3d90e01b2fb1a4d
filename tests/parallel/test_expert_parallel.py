"""Expert parallelism over the data-parallel ranks (Gloo, real processes): each of two ranks holds half of every MoE
layer's experts and trains its own rows, sending each token to its expert's rank and back (all-to-all). The group
ends with one process's results: forward, forward_backward with two LoRA tenants (expert adapters included), three
clipped AdamW steps, the gathered adapters, gradients and moments, sampling (every rank decodes the same rows), and a
one-process checkpoint loaded into the split layout; on Qwen3 MoE, DeepSeek V3 (sigmoid group routing, MLA, shared
experts) and Qwen3.5 MoE. A full fine-tune is refused by name."""

from __future__ import annotations

import numpy as np
import pytest
from split_parity import assert_same_as_one_process, one_process_reference, run_split_ranks


@pytest.mark.parametrize(("preset", "experts"), [("tiny-qwen3-moe", "dp"), ("tiny-qwen3-moe", "dp-checkpointed"),
                                                 ("tiny-deepseek-v3", "dp"), ("tiny-deepseek-v3", "dp-grouped"),
                                                 ("tiny-qwen3.5-moe", "dp")])
def test_experts_over_data_parallel_ranks_equal_one_process(tiny_model_dir, preset: str, experts: str) -> None:
    """-checkpointed: activation checkpointing, so every layer's forward (and its exchanges) runs again in backward;
    -grouped: each rank's experts run as grouped GEMMs (the one process runs them one by one)."""
    model_dir = str(tiny_model_dir(preset))
    single = one_process_reference(model_dir)
    ranks = run_split_ranks(model_dir, 2, 1, checkpoint=single["initial"]["b"], experts=experts)
    for rank, got in ranks.items():
        assert isinstance(got, dict), f"rank {rank}:\n{got}"
        assert_same_as_one_process(got, single, f"{preset} dp2 experts rank {rank}")
        # Tokens went to their experts' ranks: per MoE layer two exchanges of tokens (and one of counts, one of
        # adapter slots) in each forward, two more in each backward.
        assert got["collective_calls"].get("all_to_all", 0) > 0, got["collective_calls"]
        for o, e in zip(got["loaded_logprobs"], single["initial_logprobs"], strict=True):
            np.testing.assert_allclose(o, e, atol=1e-5, err_msg=f"{preset} rank {rank}: a loaded checkpoint")


LORA_TENANTS = (("a", 4, 1), ("b", 8, 2))
EXPERTS_OVER_DP = {"fully_sharded_data_parallel_size": 2, "expert_parallel_size": 2}
PRESET = "tiny-qwen3-moe"


@pytest.fixture(scope="module")
def one_process(preset_cache) -> dict:
    from live_server import live_server
    from parallel_runs import train_and_sample

    with live_server(base_model=PRESET) as url:
        return train_and_sample(url, tenants=LORA_TENANTS, base_model=PRESET)


def _assert_one_process_results(got: dict, one_process: dict) -> None:
    from parallel_runs import assert_same_as_one_process_run

    assert set(got["losses"]) == {name for name, _, _ in LORA_TENANTS}, got
    assert_same_as_one_process_run(got, one_process)


def test_a_server_with_experts_over_data_parallel_ranks_equals_one_process(one_process) -> None:
    """Through the SDK: two LoRA tenants train on ragged batches (rows split between the ranks, tokens sent to their
    experts' ranks) and sample greedily exactly as on a one-process server; a full fine-tune is refused by name."""
    import tinker
    from live_server import live_server
    from parallel_runs import train_and_sample

    with live_server(base_model=PRESET, backend_config=EXPERTS_OVER_DP) as url:
        assert "parallel: 2 ranks (2 data-parallel x 1 tensor-parallel)" in url.log_tail(), url.log_tail()
        got = train_and_sample(url, tenants=LORA_TENANTS, base_model=PRESET)
        with tinker.ServiceClient() as service, pytest.raises(tinker.RequestFailedError) as refused:
            service.create_lora_training_client(base_model=PRESET, rank=0).result()
        assert refused.value.category == "user", refused.value
        assert "full fine-tuning" in str(refused.value) and "expert_parallel_size" in str(refused.value), \
            refused.value
    _assert_one_process_results(got, one_process)


def test_a_sampler_engine_beside_experts_over_data_parallel_ranks_samples_as_one_process(one_process) -> None:
    """colocate_all false: the trainer's ranks each hold half the experts; every sync gathers the adapters whole
    (a collective of both ranks) and sends them to an engine that holds every expert."""
    from live_server import live_server
    from parallel_runs import train_and_sample

    config = {**EXPERTS_OVER_DP, "colocate_all": False, "generator.inference_engine.num_engines": 1,
              "inference_engine_devices": ["cpu"]}
    with live_server(base_model=PRESET, backend_config=config) as url:
        got = train_and_sample(url, tenants=LORA_TENANTS, base_model=PRESET)
        syncs = [line for line in url.log_tail(2000).splitlines() if "weight sync " in line]
    assert len(syncs) == len(LORA_TENANTS), syncs
    _assert_one_process_results(got, one_process)


def test_killing_a_rank_that_holds_half_the_experts_restarts_the_group_with_the_same_weights(one_process) -> None:
    """kill -9 of the worker rank (half of every MoE layer's experts) after tenant b's second step: the engine's next
    collective fails, the group restarts, each rank restores its experts' part of the newest recovery snapshot, and
    the run ends as an undisturbed one."""
    from live_server import live_server
    from parallel_runs import train_and_sample

    from skyrl_tx.bench.live_server import healthy

    config = {**EXPERTS_OVER_DP, "recovery_snapshot_every_steps": 1}
    with live_server(base_model=PRESET, backend_config=config) as url:
        got = train_and_sample(url, kill_after=("b", 1), kill="worker", tenants=LORA_TENANTS, base_model=PRESET)
        assert healthy(url)
        assert "broke the group" in url.log_tail(400), url.log_tail()
    _assert_one_process_results(got, one_process)
