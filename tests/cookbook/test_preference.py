"""Preference recipes: DPO on a small local preference file, and the `shorter` pairwise-preference RL recipe."""

from __future__ import annotations

import json
import math
from pathlib import Path


def test_dpo_on_local_preference_file(run_recipe, rest, model_dir: Path) -> None:
    """dataset=hhh reads Anthropic/hh-rlhf/{train,test}.jsonl from the working directory (tests/cookbook/data):
    64 synthetic pairs whose chosen answers all share one style, so DPO can learn it in a few steps."""
    run = run_recipe("tinker_cookbook.recipes.preference.dpo.train", f"model_name={model_dir}",
                     "renderer_name=role_colon", "dataset=hhh", "batch_size=8", "max_length=512",
                     "learning_rate=1e-3", "max_steps=4")
    run.assert_finite()
    loss = run.series("dpo_loss")
    assert len(loss) == 4, loss
    # Step 0: the policy is the reference (LoRA starts as the identity), so the loss is exactly ln 2.
    assert abs(loss[0] - math.log(2)) < 1e-3, loss
    assert loss[-1] < loss[0] - 0.05, f"DPO loss did not fall: {loss}"
    assert run.series("accuracy")[-1] >= 0.75, run.series("accuracy")
    assert run.series("margin")[-1] > 0, run.series("margin")
    # The held-out NLL evaluation (forward on the test split) ran.
    assert run.series("test/nll"), run.metrics
    final = run.checkpoints[-1]
    assert final["name"] == "final", run.checkpoints
    run_id = final["state_path"].removeprefix("tinker://").split("/", 1)[0]
    listed = {c.tinker_path for c in rest.list_checkpoints(run_id).result().checkpoints}
    assert {final["state_path"], final["sampler_path"]} <= listed, listed


def test_shorter_preference_rl(run_recipe, model_dir: Path) -> None:
    """No base_url flag: the recipe reaches the server through TINKER_BASE_URL only. compute_post_kl=True."""
    run = run_recipe("tinker_cookbook.recipes.preference.shorter.train", f"model_name={model_dir}",
                     "renderer_name=role_colon", "batch_size=2", "group_size=4", "max_tokens=16",
                     "learning_rate=1e-4", "eval_every=0", "max_steps=3")
    run.assert_finite()
    rows = [row for row in run.metrics if "env/all/reward/total" in row]
    assert len(rows) == 3, run.metrics
    v1, v2 = run.series("optim/kl_sample_train_v1"), run.series("optim/kl_sample_train_v2")
    assert all(abs(x) < 1e-4 for x in v1) and all(0 <= x < 1e-6 for x in v2), (v1, v2)
    assert all(math.isfinite(x) for x in run.series("kl_pre_post_v1")), run.metrics
    assert run.checkpoints and run.checkpoints[-1]["name"] == "final", run.checkpoints


def test_shorter_with_its_default_model_name_and_renderer(run_recipe) -> None:
    """Unchanged defaults: model_name=Qwen/Qwen3.5-4B (served through --model-alias, tokenizer from a local
    directory of that name) and renderer qwen3_5_disable_thinking (the tiny tokenizer's qwen3.5 special tokens)."""
    run = run_recipe("tinker_cookbook.recipes.preference.shorter.train", "batch_size=2", "group_size=4",
                     "max_tokens=16", "eval_every=0", "max_steps=2")
    run.assert_finite()
    config = json.loads((run.log_path / "config.json").read_text())
    assert config["model_name"] == "Qwen/Qwen3.5-4B" and config["renderer_name"] == "qwen3_5_disable_thinking"
    v1 = run.series("optim/kl_sample_train_v1")
    assert len(v1) == 2 and all(abs(x) < 1e-4 for x in v1), v1
