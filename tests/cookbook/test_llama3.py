"""The Llama 3 family: a server on tiny-llama3 and the cookbook's llama3 renderer (<|start_header_id|>, <|eot_id|>)."""

from __future__ import annotations

import importlib.resources
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.cookbook_full


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> Path:
    return tiny_model_dir("tiny-llama3")


@pytest.fixture(scope="module")
def server_options(model_dir: Path) -> dict[str, Any]:
    return {"base_model": "tiny-llama3", "aliases": [str(model_dir)], "backend_config": {"max_lora_adapters": 32}}


def test_chat_sl_llama3_renderer(run_recipe, model_dir: Path, cookbook_installed: None) -> None:
    conversations = importlib.resources.files("tinker_cookbook") / "example_data" / "conversations.jsonl"
    run = run_recipe("tinker_cookbook.recipes.chat_sl.train", f"model_name={model_dir}", "renderer_name=llama3",
                     f"dataset={conversations}", "batch_size=16", "max_length=512", "lora_rank=8",
                     "learning_rate=1e-2", "save_every=0", "eval_every=0", "max_steps=4")
    run.assert_finite()
    nll = run.series("train_mean_nll")
    assert nll[-1] < nll[0] - 0.5, nll
    assert "<|start_header_id|>" in run.output


def test_on_policy_distillation_llama3(run_recipe, model_dir: Path) -> None:
    run = run_recipe("tinker_cookbook.recipes.distillation.on_policy_distillation", f"model_name={model_dir}",
                     f"teacher_model={model_dir}", "renderer_name=llama3", "dataset=deepmath", "group_size=2",
                     "groups_per_batch=4", "max_tokens=16", "lora_rank=8", "learning_rate=1e-4", "eval_every=0",
                     "save_every=0", "max_steps=2", "loss_fn=importance_sampling")
    run.assert_finite()
    teacher_kl = run.series("teacher_kl")
    assert abs(teacher_kl[0]) < 1e-4, teacher_kl
    assert all(abs(x) < 1e-4 for x in run.series("optim/kl_sample_train_v1")), run.metrics
