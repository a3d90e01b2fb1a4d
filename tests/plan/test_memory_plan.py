"""The memory plan's LoRA and optimizer lines against what the C++ core holds (every family's tiny preset), the
start-up refusal naming the key to change, and `skyrl-tx plan` on a published config."""

from __future__ import annotations

import subprocess
import sys

import pytest
from skyrl_tx.config import BackendSettings
from skyrl_tx.errors import InvalidArgumentError
from skyrl_tx.models.hf_config import load_decoder_config
from skyrl_tx.plan.capacity import check_fits
from skyrl_tx.plan.memory import GiB, _linear_widths, plan_memory
from skyrl_tx.types import AdamParams, Datum, TrainRequest

RANK = 4
FAMILIES = ["tiny-qwen3", "tiny-qwen3-tied", "tiny-llama3", "tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-qwen3.5",
            "tiny-qwen3.5-moe"]


@pytest.mark.parametrize("preset", FAMILIES)
def test_lora_widths_are_the_cores_adapter_and_adamw_sizes(preset: str, tiny_model_dir) -> None:
    """An adapter of rank R holds R x (in + out) factors per LoRA linear; the plan's widths must name the same
    linears the core builds (lm_head, experts, MLA and Gated DeltaNet projections included), and a trained adapter's
    AdamW state is two float32 moments of them."""
    from skyrl_tx.backend.native import NativeBackend

    model_dir = tiny_model_dir(preset)
    config = load_decoder_config(model_dir)
    backend = NativeBackend(model_dir, BackendSettings(max_lora_adapters=1, max_lora_rank=RANK))
    backend.create_model("a", lora_rank=RANK)
    factors = backend.trainable_state("a")
    assert sum(t.numel() for t in factors.values()) == _linear_widths(config, 1, 1) * RANK
    tokens = list(range(3, 11))
    datum = Datum(tokens[:-1], {"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
    backend.forward_backward([TrainRequest("a", [datum])])
    backend.optim_step("a", AdamParams(learning_rate=1e-3))
    assert backend.optimizer_state_bytes("a") == 2 * _linear_widths(config, 1, 1) * RANK * 4


def test_refusal_names_the_largest_line_and_its_key(tiny_model_dir) -> None:
    config = load_decoder_config(tiny_model_dir("tiny-qwen3"))
    settings = BackendSettings(max_sampling_sequences=4096, max_sampling_length=4096)
    plan = plan_memory(config, settings)
    assert plan.devices[0].largest_adjustable() == "kv_cache"
    with pytest.raises(InvalidArgumentError, match="KV cache .* max_sampling_sequences or max_sampling_length"):
        check_fits(config, settings, capacity={"cpu": int(0.5 * plan.devices[0].total)})
    assert check_fits(config, settings, capacity={"cpu": 2 * plan.devices[0].total}).devices[0].total > 0


def test_plan_command_prints_every_line_of_a_published_model_offline() -> None:
    """`skyrl-tx plan` knows the published configs by name (no download) and exits 1 when a device cannot hold the
    plan (here a CPU host asked to hold Qwen3-30B-A3B's experts with eight LoRA slots each)."""
    run = subprocess.run([sys.executable, "-m", "skyrl_tx.cli", "plan", "--base-model", "Qwen/Qwen3-30B-A3B",
                          "--backend-config", '{"dtype": "bfloat16"}'], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stderr
    for label in ("base weights", "LoRA slots", "AdamW", "KV cache", "activations", "DOES NOT FIT"):
        assert label in run.stdout
    weights = float(run.stdout.split("base weights")[1].split()[0])
    assert weights == pytest.approx(30.53e9 * 2 / GiB, rel=0.01)  # the model card's 30.5B parameters in bf16


def test_snapshot_budget_by_default_is_what_the_plan_leaves(tiny_model_dir) -> None:
    """snapshot_memory_mb 0 (the default): full fine-tunes' snapshots get the device's memory less the plan's peak,
    so a bf16 8B full fine-tune's 16 GB snapshot is not refused by a fixed 8 GB default; a set value wins."""
    from skyrl_tx.plan.capacity import snapshot_budget_bytes
    from skyrl_tx.plan.published import PUBLISHED
    from skyrl_tx.models.hf_config import decoder_config_from_dict

    config = load_decoder_config(tiny_model_dir("tiny-qwen3"))
    settings = BackendSettings()
    peak = plan_memory(config, settings).devices[0].total
    assert snapshot_budget_bytes(config, settings, default=1, capacity={"cpu": peak + 3 * GiB}) == 3 * GiB
    assert snapshot_budget_bytes(config, settings, default=7, capacity={}) == 7
    eight_b = decoder_config_from_dict(PUBLISHED["Qwen/Qwen3-8B"])
    on_h200 = BackendSettings(dtype="bfloat16", device="cuda:0", fully_sharded_data_parallel_size=8,
                              max_lora_adapters=1, train_micro_batch_tokens=4096)
    budget = snapshot_budget_bytes(eight_b, on_h200, default=0, capacity={"cuda:0": 141 * GiB})
    assert budget > 16.4e9  # one frozen bf16 copy of the 8.19B weights fits beside the plan


def test_a_tensor_parallel_size_the_core_refuses_is_refused_by_the_plan() -> None:
    """Qwen3-30B-A3B has 4 KV heads: tensor_parallel_size 8 is refused before anything loads, pointing to expert
    parallelism over data-parallel ranks; 4 plans (its experts then whole on every rank unless spread)."""
    from skyrl_tx.models.hf_config import decoder_config_from_dict
    from skyrl_tx.plan.published import PUBLISHED

    config = decoder_config_from_dict(PUBLISHED["Qwen/Qwen3-30B-A3B"])
    with pytest.raises(InvalidArgumentError, match=r"KV heads \(4\); choose a divisor of 4 .*expert_parallel_size"):
        plan_memory(config, BackendSettings(device="cuda", tensor_parallel_size=8, expert_parallel_size=8))
    four = plan_memory(config, BackendSettings(device="cuda", tensor_parallel_size=4, expert_parallel_size=4))
    whole = plan_memory(config, BackendSettings(device="cuda", tensor_parallel_size=4))
    assert four.devices[0].lines["weights"] < whole.devices[0].lines["weights"] / 3  # the experts spread
