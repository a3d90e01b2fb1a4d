"""On-policy distillation with the teacher equal to the student's base model: teacher KL ≈ 0 at step 0."""

from __future__ import annotations

from pathlib import Path

import pytest

MODULE = "tinker_cookbook.recipes.distillation.on_policy_distillation"


def distill(run_recipe, model_dir: Path, renderer: str, *extra: str):
    """dataset=deepmath reads zwhe99/DeepMath-103K/train.jsonl from the working directory (tests/cookbook/data)."""
    return run_recipe(MODULE, f"model_name={model_dir}", f"teacher_model={model_dir}",
                      f"renderer_name={renderer}", "dataset=deepmath", "group_size=2", "groups_per_batch=4",
                      "max_tokens=16", "lora_rank=8", "learning_rate=1e-4", "eval_every=0", "save_every=0",
                      "max_steps=2", "loss_fn=importance_sampling", *extra)


def check_distillation(run) -> None:
    run.assert_finite()
    teacher_kl = run.series("teacher_kl")
    assert len(teacher_kl) == 2, run.metrics
    # Step 0: student (LoRA = identity) and teacher (base sampler) are the same model.
    assert abs(teacher_kl[0]) < 1e-4, teacher_kl
    assert all(abs(x) < 0.1 for x in teacher_kl), teacher_kl
    v1 = run.series("optim/kl_sample_train_v1")
    assert all(abs(x) < 1e-4 for x in v1), v1
    assert run.checkpoints and run.checkpoints[-1]["name"] == "final", run.checkpoints


def test_on_policy_distillation_teacher_is_student(run_recipe, model_dir: Path) -> None:
    check_distillation(distill(run_recipe, model_dir, "qwen3"))


@pytest.mark.cookbook_full
def test_on_policy_distillation_role_colon_teacher_checkpoint(run_recipe, model_dir: Path) -> None:
    """teacher_checkpoint: the teacher samples from a saved sampler checkpoint of another (untrained) run."""
    first = distill(run_recipe, model_dir, "role_colon")
    check_distillation(first)
    # The first run's final sampler weights moved only slightly: still a close teacher.
    run = distill(run_recipe, model_dir, "role_colon", f"teacher_checkpoint={first.checkpoints[-1]['sampler_path']}")
    run.assert_finite()
    assert all(abs(x) < 0.1 for x in run.series("teacher_kl")), run.series("teacher_kl")
