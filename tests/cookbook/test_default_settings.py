"""Recipes with their default settings: rl_loop, rubric and rl_numerics_check, each under its default model name
(served through --model-alias, tokenizer from a local directory of that name) and its default loss.

Only sizes are lowered (steps, batch, group, max_tokens); model names, renderers and losses stay the recipes' own:
rl_loop and rubric train with stable_reinforce (sampler records stability info, datums carry provenance spans),
rl_numerics_check with importance_sampling. Their hub datasets are written here into the working directory under
their hub ids (`openai/gsm8k`, `Salesforce/wikitext` with a README declaring the config the recipe asks for) or at
the recipe's default relative path (rubric's `tinker_cookbook/example_data/*.jsonl`, from its own generate_data).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

# Default model names of the recipes below (rl_loop, rubric's policy and grader, rl_numerics_check).
DEFAULT_MODELS = ("Qwen/Qwen3.5-9B-Base", "Qwen/Qwen3.5-9B", "Qwen/Qwen3.6-35B-A3B")
# rl_numerics_check asks for a Tinker variant id; the cookbook loads the tokenizer by the name before the ':'.
NUMERICS_MODEL = "Qwen/Qwen3.6-35B-A3B:peft:262144"
# rl_loop's question suffix: the policy is warm-started to answer with one of these boxed numbers.
GSM8K_SUFFIX = " Provide a numerical answer without units, written inside \\boxed{}."
ANSWERS = (1, 2)
# rl_loop's few-shot turn before every question (a local in its main(), copied from 0.6.1).
GSM8K_PREFIX = [
    {"role": "user", "content": "How many r's are in strawberry?" + GSM8K_SUFFIX},
    {"role": "assistant", "content": "Let's spell the word out and number all the letters: 1) s 2) t 3) r 4) a 5) w "
                                     "6) b 7) e 8) r 9) r 10) y. We have r's at positions 3, 8, and 9. \\boxed{3}"},
]


@pytest.fixture(scope="module")
def server_options(server_options: dict[str, Any]) -> dict[str, Any]:
    # rubric's grader samples a ~300-token prompt + max_tokens=2048 (fixed in its code): more than the default
    # max_sampling_length (2048); the tiny preset has 4096 positions.
    # The default 16 rows: rl_loop's default group (num_samples=16) re-sends one prompt, a prefix-cache hit that
    # needs every row (tests/sampling/test_prefix_cache.py).
    return {**server_options, "aliases": [*server_options["aliases"], *DEFAULT_MODELS, NUMERICS_MODEL],
            "backend_config": {**server_options["backend_config"], "max_sampling_length": 4096}}


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def hub_dataset(root: Path, name: str, config: str, rows: list[dict[str, Any]]) -> None:
    """A local stand-in for hub dataset `name` with `config` (train split): datasets.load_dataset(name, config)
    reads it from the working directory through the README's `configs` front matter."""
    write_jsonl(root / name / config / "train.jsonl", rows)
    (root / name / "README.md").write_text(f"---\nconfigs:\n- config_name: {config}\n  data_files:\n"
                                           f"  - split: train\n    path: {config}/train.jsonl\n---\n")


def gsm8k_rows(count: int, rng: random.Random) -> list[dict[str, Any]]:
    rows = []
    for _ in range(count):
        a, answer = rng.randint(2, 9), rng.choice(ANSWERS)
        rows.append({"question": f"Tom had {a + answer} apples and ate {a}. How many are left?",
                     "answer": f"{a + answer} - {a} = {answer}\n#### {answer}"})
    return rows


def wikitext_rows(chars: int, rng: random.Random) -> list[dict[str, Any]]:
    """Pseudo-English lines (with the counting task's target words) adding up to `chars` characters."""
    words = ("the", "after", "before", "during", "many", "time", "over", "river", "city", "was", "built", "in",
             "and", "of", "a", "known", "until", "while", "station", "people")
    rows, total = [], 0
    while total < chars:
        line = " ".join(rng.choice(words) for _ in range(rng.randint(12, 30))).capitalize() + " ."
        rows.append({"text": f" {line} \n"})
        total += len(line) + 1
    return rows


@pytest.fixture(scope="module")
def workdir(workdir: Path, model_dir: Path) -> Path:
    rng = random.Random(0)
    for name in DEFAULT_MODELS:
        (workdir / name).parent.mkdir(parents=True, exist_ok=True)
        (workdir / name).symlink_to(model_dir, target_is_directory=True)
    hub_dataset(workdir, "openai/gsm8k", "main", gsm8k_rows(16, rng))  # 2 batches of 8
    # rl_numerics_check cuts each problem's pages out of one corpus: (num_pages_max + 4) pages of 10,000
    # characters, plus 10%, by default.
    hub_dataset(workdir, "Salesforce/wikitext", "wikitext-103-raw-v1", wikitext_rows(480_000, rng))
    from tinker_cookbook.recipes.rubric.generate_data import generate_dataset

    (workdir / "tinker_cookbook/example_data").mkdir(parents=True)  # the recipe's default relative paths
    generate_dataset(num_train=8, num_test=2, seed=0, write_dir=str(workdir / "tinker_cookbook/example_data"))
    return workdir


def config_of(run) -> dict[str, Any]:
    return json.loads((run.log_path / "config.json").read_text())


@pytest.fixture(scope="module")
def boxed_answer_policy(run_recipe, workdir: Path) -> str:
    """state_path of a Qwen/Qwen3.5-9B-Base LoRA SFT-ed (chat_sl, role_colon: rl_loop's renderer for that name)
    to answer a question ending in rl_loop's suffix with \\boxed{1} or \\boxed{2} at random. A random model never
    writes \\boxed{}: every gsm8k reward would be 0 and rl_loop would skip every training step."""
    rng = random.Random(1)
    rows = [{"messages": [*GSM8K_PREFIX, {"role": "user", "content": row["question"] + GSM8K_SUFFIX},
                          {"role": "assistant", "content": f"\\boxed{{{rng.choice(ANSWERS)}}}"}]}
            for row in gsm8k_rows(64, rng)]
    data = write_jsonl(workdir / "boxed_sft.jsonl", rows)
    run = run_recipe("tinker_cookbook.recipes.chat_sl.train", f"model_name={DEFAULT_MODELS[0]}",
                     "renderer_name=role_colon", f"dataset={data}", "batch_size=16", "max_length=512",
                     "train_on_what=last_assistant_message",
                     # The LoRA's init seed is random (the recipe sets none): at 1e-2 (linear decay) some seeds
                     # spiked and stalled at NLL 0.7-1.4; a constant 3e-3 ended at 0.08 for 4 of 4 seeds.
                     "lora_rank=8", "learning_rate=3e-3", "lr_schedule=constant", "num_epochs=20",
                     "save_every=0", "eval_every=0")
    nll = run.series("train_mean_nll")
    # From ≈ ln(vocab) to the boxed format (7 target tokens; the digit's coin flip alone is ln 2 / 7 ≈ 0.1).
    assert nll[-1] < 0.5, nll
    return run.checkpoints[-1]["state_path"]


def test_rl_loop_defaults(run_recipe, boxed_answer_policy: str, tmp_path: Path) -> None:
    """rl_loop: model Qwen/Qwen3.5-9B-Base, loss stable_reinforce. It has no load_checkpoint flag: it resumes
    from the last state in its log directory's checkpoints.jsonl, so the warm-started policy is put there."""
    log_path = tmp_path / "rl_loop"
    log_path.mkdir()
    (log_path / "checkpoints.jsonl").write_text(json.dumps({"name": "warm", "batch": 0,
                                                            "state_path": boxed_answer_policy}) + "\n")
    # Default group_size (16) and 8 questions a step: some group mixes right and wrong answers (the warm policy
    # hits about 40%; even at 10%, a step with no mixed group has odds 0.19^8 ≈ 1e-6).
    run = run_recipe("tinker_cookbook.recipes.rl_loop", "batch_size=8", "max_tokens=24", "max_steps=2",
                     log_path=log_path, log_dir_flag=False)
    run.assert_finite()
    config = config_of(run)
    assert config["model_name"] == "Qwen/Qwen3.5-9B-Base" and config["loss_fn"] == "stable_reinforce", config
    assert "Resuming from batch 0" in run.output, run.tail()
    rewards = run.series("reward/total")
    assert len(rewards) == 2, run.metrics
    # The policy answers 1 or 2 at random: rewards are neither all 0 nor all 1, groups mix and
    # forward_backward(stable_reinforce) ran on provenance-carrying datums, then optim_step (its metrics); a step
    # whose every group got one reward is skipped with a warning.
    assert 0 < sum(rewards) / 2 < 1, rewards
    assert "all advantages zero" not in run.output, run.tail()
    assert len(run.series("grad_norm")) == 2, run.metrics
    final = run.checkpoints[-1]
    assert final["name"] == "final" and final["state_path"] and final["sampler_path"], run.checkpoints


def test_rubric_defaults(run_recipe) -> None:
    """rubric: policy Qwen/Qwen3.5-9B, grader Qwen/Qwen3.6-35B-A3B (a base-model sampler, 2048 tokens per grade),
    renderer qwen3_5_disable_thinking, loss stable_reinforce, the default data paths, eval at step 0."""
    run = run_recipe("tinker_cookbook.recipes.rubric.train", "groups_per_batch=2", "train_group_size=2",
                     "max_tokens=8", "max_steps=2")
    run.assert_finite()
    config = config_of(run)
    assert config["model_name"] == "Qwen/Qwen3.5-9B" and config["loss_fn"] == "stable_reinforce", config
    assert config["renderer_name"] == "qwen3_5_disable_thinking", config
    rows = [row for row in run.metrics if "env/all/reward/total" in row]
    assert len(rows) == 2, run.metrics
    # Reward = rubric score (the grader's <score>, 0 when it writes none, as a random grader does) minus 0.1
    # without the policy's stop sequence.
    assert all(-0.1 - 1e-9 <= row["env/all/reward/total"] <= 1 for row in rows), rows
    assert len(run.series("env/all/rubric_score")) == 2, run.metrics
    v1 = run.series("optim/kl_sample_train_v1")
    assert len(v1) == 2 and all(abs(x) < 1e-4 for x in v1), v1
    # eval_every=20: the test split is graded before step 0 and after the last step.
    assert len(run.series("test/env/all/rubric_score")) == 2, run.metrics
    assert run.checkpoints[-1]["name"] == "final", run.checkpoints


def test_rl_numerics_check_defaults(run_recipe) -> None:
    """rl_numerics_check: model Qwen/Qwen3.6-35B-A3B:peft:262144, renderer qwen3_5 (tool calls), default task
    (28-36 pages of 10,000 characters from the local wikitext), loss importance_sampling. It logs the
    sampler-trainer KL this recipe exists to check."""
    run = run_recipe("tinker_cookbook.recipes.rl_numerics_check.train", "group_size=2", "groups_per_batch=2",
                     "max_tokens=8", "max_steps=2")
    run.assert_finite()
    config = config_of(run)
    assert config["model_name"] == NUMERICS_MODEL and config["loss_fn"] == "importance_sampling", config
    assert config["renderer_name"] == "qwen3_5", config
    v1, v2 = run.series("optim/kl_sample_train_v1"), run.series("optim/kl_sample_train_v2")
    assert len(v1) == 2 and all(abs(x) < 1e-4 for x in v1) and all(0 <= x < 1e-6 for x in v2), (v1, v2)
    # A random policy never answers in the tool-call format: each episode ends at its first turn with the
    # recipe's parse-failure (-0.1) or no-answer (0) reward.
    rewards = run.series("env/all/reward/total")
    assert len(rewards) == 2 and all(-0.1 - 1e-9 <= r <= 0 for r in rewards), rewards
    assert run.checkpoints[-1]["name"] == "final", run.checkpoints
