"""MoE experts as grouped GEMMs over stacked weights (backend-config grouped_expert_gemm "always"; on a CPU that is
ATen's reference of at::_grouped_mm, the op a Hopper GPU runs as one CUTLASS kernel): the Hugging Face parity tests
of test_architecture_parity.py and the sampling tests of test_architecture_sampling.py run again on backends that
group, and the grouped op runs exactly when the policy says."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from backend_parity import random_adapter, seqs_of

from skyrl_tx.backend.native import NativeBackend
from skyrl_tx.config import BackendSettings
from skyrl_tx.types import Datum, TrainRequest


def sibling(name: str):
    """A test module beside this one (--import-mode=importlib puts none on sys.path), loaded as a fresh module."""
    spec = importlib.util.spec_from_file_location(f"grouped_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Collected here again, with this module's fixtures (backends that group).
parity, sampling = sibling("test_architecture_parity"), sibling("test_architecture_sampling")
test_adapter_on_every_module_equals_merged_transformers = parity.test_adapter_on_every_module_equals_merged_transformers
test_mixed_adapter_batch_equals_rows_alone = parity.test_mixed_adapter_batch_equals_rows_alone
test_lora_gradients_and_adamw_equal_merged_autograd = parity.test_lora_gradients_and_adamw_equal_merged_autograd
test_greedy_base_and_adapter_in_one_batch_match_transformers = \
    sampling.test_greedy_base_and_adapter_in_one_batch_match_transformers
test_sampled_logprobs_equal_a_forward_pass = sampling.test_sampled_logprobs_equal_a_forward_pass

PRESETS = ["tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-qwen3.5-moe"]
MOE_LAYERS = {"tiny-qwen3-moe": 2, "tiny-deepseek-v3": 2, "tiny-qwen3.5-moe": 4}


@pytest.fixture(scope="module", params=PRESETS)
def preset(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def path(preset: str, tiny_model_dir) -> Path:
    return tiny_model_dir(preset)


@pytest.fixture(scope="module")
def backend(path: Path) -> NativeBackend:
    return NativeBackend(path, BackendSettings(max_lora_adapters=3, max_lora_rank=8, grouped_expert_gemm="always"))


@pytest.fixture(scope="module")
def env(path: Path) -> tuple[Path, NativeBackend, dict[str, torch.Tensor]]:
    """test_architecture_sampling's environment (a random nonzero adapter "lora"), grouped."""
    return sampling.backend_with_random_adapter(path, grouped_expert_gemm="always")


def grouped_gemm_calls(run) -> int:
    with torch.profiler.profile() as prof:
        run()
    return sum(e.count for e in prof.key_averages() if e.key == "aten::_grouped_mm")


# "auto" groups only on CUDA bfloat16 with compute capability >= 9.0 (tests/gpu checks that side).
@pytest.mark.parametrize("policy", ["always", "never", "auto"])
def test_grouped_gemms_run_exactly_when_the_policy_says(path: Path, preset: str, policy: str) -> None:
    backend = NativeBackend(path, BackendSettings(max_lora_adapters=1, max_lora_rank=8, grouped_expert_gemm=policy))
    random_adapter(backend, "a", seed=5)
    seqs = seqs_of(backend.decoder_config.vocab_size, [9, 14], seed=6)
    data = [Datum(s[:-1], {"target_tokens": s[1:], "weights": [1.0] * (len(s) - 1)}) for s in seqs]
    forward = grouped_gemm_calls(lambda: backend.forward([TrainRequest("a", data)]))
    training = grouped_gemm_calls(lambda: backend.forward_backward([TrainRequest("a", data)]))
    grouped = policy == "always"
    # Per MoE layer: gate and up in one grouped GEMM, down in another; the backward adds two for the input gradient.
    assert forward == (2 * MOE_LAYERS[preset] if grouped else 0)
    assert training == (4 * MOE_LAYERS[preset] if grouped else 0)


def test_full_finetune_runs_each_expert_on_its_own_weights(path: Path) -> None:
    """A full fine-tune's expert weights are trainable views of the stacks: they take the per-expert path, whose
    gradients reach each expert's own weight (the grouped op would give the frozen stack's none)."""
    backend = NativeBackend(path, BackendSettings(max_lora_adapters=1, max_lora_rank=8, grouped_expert_gemm="always"))
    backend.create_model("full", lora_rank=0)
    seqs = seqs_of(backend.decoder_config.vocab_size, [9, 14], seed=8)
    data = [Datum(s[:-1], {"target_tokens": s[1:], "weights": [1.0] * (len(s) - 1)}) for s in seqs]
    assert grouped_gemm_calls(lambda: backend.forward_backward([TrainRequest("full", data)])) == 0
    grads = backend.trainable_grads("full")
    assert grads["model.layers.1.mlp.experts.0.down_proj.weight"].abs().max() > 0 or \
        grads["model.layers.1.mlp.experts.1.down_proj.weight"].abs().max() > 0
