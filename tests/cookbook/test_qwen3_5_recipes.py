"""chat_sl and math_rl with their *default* model names and renderers, served by the real Qwen3.5 architecture
(the tiny-qwen3.5 preset: Gated DeltaNet + gated attention) under those names through --model-alias.

chat_sl's default model is Qwen/Qwen3.5-9B-Base (renderer role_colon by the cookbook's model table); math_rl's is
Qwen/Qwen3.5-9B (renderer qwen3_5, thinking). math_rl starts from a short chat_sl run under its own model name and
default renderer (as tests/cookbook/test_math_rl.py does for the dense preset) so that rollouts sometimes answer
and rewards differ within groups; that warm start keeps the renderer qwen3_5, which math_rl then resolves itself.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

CHAT_SL_DEFAULT = "Qwen/Qwen3.5-9B-Base"
MATH_RL_DEFAULT = "Qwen/Qwen3.5-9B"


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> Path:
    return tiny_model_dir("tiny-qwen3.5")


@pytest.fixture(scope="module")
def server_options(server_options: dict[str, Any], model_dir: Path) -> dict[str, Any]:
    return {**server_options, "base_model": "tiny-qwen3.5",
            "aliases": [str(model_dir), CHAT_SL_DEFAULT, MATH_RL_DEFAULT]}


@pytest.fixture(scope="module")
def workdir(workdir: Path, model_dir: Path) -> Path:
    for name in (CHAT_SL_DEFAULT, MATH_RL_DEFAULT):  # where get_tokenizer finds the tokenizer of that name
        (workdir / name).parent.mkdir(parents=True, exist_ok=True)
        (workdir / name).symlink_to(model_dir, target_is_directory=True)
    return workdir


def config_of(run) -> dict[str, Any]:
    return json.loads((run.log_path / "config.json").read_text())


def test_chat_sl_default_model_and_renderer(run_recipe, workdir: Path) -> None:
    run = run_recipe("tinker_cookbook.recipes.chat_sl.train", f"dataset={workdir / 'arithmetic_sft.jsonl'}",
                     "batch_size=32", "max_length=128", "lora_rank=8", "learning_rate=1e-2", "max_steps=6",
                     "save_every=0", "eval_every=0")
    config = config_of(run)
    # No renderer flag: the recipe resolves the cookbook's choice for a base model and records it.
    assert config["model_name"] == CHAT_SL_DEFAULT and config["renderer_name"] == "role_colon", config
    run.assert_finite()
    nll = run.series("train_mean_nll")
    assert nll[0] == pytest.approx(math.log(2112), abs=0.5), nll  # random init: about ln(vocab)
    assert nll[-1] < nll[0] - 1, f"training loss did not fall: {nll}"


@pytest.fixture(scope="module")
def warm_start(run_recipe, workdir: Path) -> str:
    run = run_recipe("tinker_cookbook.recipes.chat_sl.train", f"model_name={MATH_RL_DEFAULT}",
                     f"dataset={workdir / 'arithmetic_sft.jsonl'}", "batch_size=32", "max_length=128",
                     "lora_rank=8", "learning_rate=1e-2", "num_epochs=3", "lr_schedule=linear", "save_every=0",
                     "eval_every=0")
    nll = run.series("train_mean_nll")
    assert nll[-1] < nll[0] - 3, nll
    return run.checkpoints[-1]["state_path"]


def test_math_rl_default_model_and_renderer(run_recipe, warm_start: str) -> None:
    """Synchronous: the sampler's logprobs (recurrent-state decode) equal the trainer's (chunked delta rule)."""
    run = run_recipe("tinker_cookbook.recipes.math_rl.train", f"load_checkpoint_path={warm_start}", "group_size=4",
                     "groups_per_batch=16", "max_tokens=8", "lora_rank=8", "learning_rate=3e-4", "eval_every=0",
                     "save_every=0", "max_steps=2")
    config = config_of(run)
    assert config["model_name"] == MATH_RL_DEFAULT and config["loss_fn"] == "stable_reinforce", config
    assert config["renderer_name"] == "qwen3_5", config
    run.assert_finite()
    v1, v2 = run.series("optim/kl_sample_train_v1"), run.series("optim/kl_sample_train_v2")
    assert len(v1) == 2 and all(abs(x) < 1e-4 for x in v1), v1
    assert all(0 <= x < 1e-6 for x in v2), v2
    assert max(run.series("env/all/by_group/frac_mixed")) > 0, "some groups had different rewards (so it trained)"
