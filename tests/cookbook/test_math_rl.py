"""math_rl (rl.train) with env=arithmetic under importance_sampling, ppo and cispo, synchronous and off-policy.

A random tiny model never ends its answer with the role_colon stop string, so every rollout would get the
same format penalty, every advantage would be 0 and nothing would train. The module therefore starts from a
short chat_sl run on local arithmetic conversations (tests/cookbook/data/arithmetic_sft.jsonl, the env's own
few-shot format): the warm-started policy sometimes stops and answers with a number, rewards differ within
groups, and the RL steps really update the weights. math_rl loads it with `load_checkpoint_path`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

MODULE = "tinker_cookbook.recipes.math_rl.train"


@pytest.fixture(scope="module")
def warm_start(run_recipe, model_dir: Path, workdir: Path) -> str:
    """state_path of a policy SFT-ed on arithmetic conversations (chat_sl), for load_checkpoint_path."""
    run = run_recipe("tinker_cookbook.recipes.chat_sl.train", f"model_name={model_dir}", "renderer_name=role_colon",
                     f"dataset={workdir / 'arithmetic_sft.jsonl'}", "batch_size=32", "max_length=128",
                     "lora_rank=8", "learning_rate=1e-2", "num_epochs=3", "lr_schedule=linear", "save_every=0",
                     "eval_every=0")
    nll = run.series("train_mean_nll")
    assert nll[-1] < nll[0] - 3, nll  # from ≈ ln(vocab) to a policy that answers in the few-shot format
    return run.checkpoints[-1]["state_path"]


def math_rl(run_recipe, model_dir: Path, warm_start: str, loss_fn: str | None, *extra: str, max_steps: int = 3,
            groups_per_batch: int = 16):
    # 16 groups: a batch where every group got the same reward (nothing to learn) becomes vanishingly rare.
    return run_recipe(MODULE, f"model_name={model_dir}", "renderer_name=role_colon", "env=arithmetic",
                      f"load_checkpoint_path={warm_start}", "group_size=4", f"groups_per_batch={groups_per_batch}",
                      "max_tokens=8",
                      "lora_rank=8", "learning_rate=3e-4", "eval_every=0", "save_every=0", f"max_steps={max_steps}",
                      *([f"loss_fn={loss_fn}"] if loss_fn else []), *extra)


def check_rl_run(run, steps: int) -> None:
    run.assert_finite()
    rows = [row for row in run.metrics if "env/all/reward/total" in row]  # (not the closing token-count row)
    assert len(rows) == steps, run.metrics
    for row in rows:
        assert -0.1 - 1e-9 <= row["env/all/reward/total"] <= 1.0, row
    # Some groups had different rewards (so advantages were nonzero and the loss moved the weights).
    assert max(run.series("env/all/by_group/frac_mixed")) > 0, run.series("env/all/by_group/frac_mixed")
    # The final checkpoint is recorded (state + sampler) where the recipe keeps them.
    final = run.checkpoints[-1]
    assert final["name"] == "final" and final["state_path"] and final["sampler_path"], run.checkpoints


def check_sampler_trainer_agree(run) -> None:
    """Synchronous RL: the rollouts' logprobs (sampler) equal the training forward's (trainer), KL ≈ 0."""
    v1, v2 = run.series("optim/kl_sample_train_v1"), run.series("optim/kl_sample_train_v2")
    assert all(abs(x) < 1e-4 for x in v1), v1
    assert all(0 <= x < 1e-6 for x in v2), v2


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo", "cispo"])
def test_math_rl_synchronous(run_recipe, model_dir: Path, warm_start: str, loss_fn: str) -> None:
    run = math_rl(run_recipe, model_dir, warm_start, loss_fn)
    check_rl_run(run, 3)
    check_sampler_trainer_agree(run)
    assert json.loads((run.log_path / "config.json").read_text())["loss_fn"] == loss_fn


def off_policy(run_recipe, model_dir: Path, warm_start: str, loss_fn: str) -> None:
    run = math_rl(run_recipe, model_dir, warm_start, loss_fn, "max_steps_off_policy=2", max_steps=4)
    check_rl_run(run, 4)
    # Rollouts come from the sampler of this step or an earlier one. The recipe never drops a finished group
    # for staleness (AsyncConfig's docstring), so a slow rollout may be trained more than
    # max_steps_off_policy steps late: the bound is the step index, and the first step is on-policy.
    staleness = run.series("async/staleness_max")
    assert staleness[0] == 0 and all(0 <= s <= step for step, s in enumerate(staleness)), staleness
    # Off-policy rollouts come from saved sampler checkpoints: the initial one is recorded first.
    assert run.checkpoints[0]["name"] == "000000" and run.checkpoints[0]["sampler_path"], run.checkpoints
    # Rollouts of a fresh sampler (staleness 0) agree with the trainer; stale ones need not.
    fresh = [row["optim/kl_sample_train_v1"] for row in run.metrics
             if row.get("async/staleness_max") == 0 and "optim/kl_sample_train_v1" in row]
    assert fresh and all(abs(x) < 1e-4 for x in fresh), run.series("optim/kl_sample_train_v1")


def test_math_rl_off_policy_async_importance_sampling(run_recipe, model_dir: Path, warm_start: str) -> None:
    off_policy(run_recipe, model_dir, warm_start, "importance_sampling")


@pytest.mark.cookbook_full
@pytest.mark.parametrize("loss_fn", ["ppo", "cispo"])
def test_math_rl_off_policy_async(run_recipe, model_dir: Path, warm_start: str, loss_fn: str) -> None:
    off_policy(run_recipe, model_dir, warm_start, loss_fn)


@pytest.mark.cookbook_full
def test_math_rl_stream_minibatch_substeps_post_kl(run_recipe, model_dir: Path, warm_start: str) -> None:
    """Several forward_backward per optim_step (stream minibatch), and compute_post_kl (compute_logprobs)."""
    run = math_rl(run_recipe, model_dir, warm_start, "importance_sampling",
                  "stream_minibatch_config.groups_per_batch=16", "stream_minibatch_config.num_minibatches=2",
                  "compute_post_kl=true")
    check_rl_run(run, 3)
    check_sampler_trainer_agree(run)
    assert len(run.series("kl_pre_post_v1")) == 3  # compute_logprobs on the post-step sampler ran each step


@pytest.mark.cookbook_full
def test_math_rl_num_substeps(run_recipe, model_dir: Path, warm_start: str) -> None:
    run = math_rl(run_recipe, model_dir, warm_start, "ppo", "num_substeps=2",
                  'loss_fn_config={"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}')
    check_rl_run(run, 3)
    # The second substep trains on logprobs the first one already moved: small, not 0.
    assert all(abs(x) < 0.1 for x in run.series("optim/kl_sample_train_v1")), run.series("optim/kl_sample_train_v1")


def test_math_rl_default_loss(run_recipe, model_dir: Path, warm_start: str) -> None:
    """No loss_fn flag: the recipe's default, stable_reinforce (0.6.1), whose sampler records stability info
    (record_stability_info) and whose datums carry provenance spans naming the sampled sequences."""
    run = math_rl(run_recipe, model_dir, warm_start, None)
    check_rl_run(run, 3)
    check_sampler_trainer_agree(run)
    assert json.loads((run.log_path / "config.json").read_text())["loss_fn"] == "stable_reinforce"
