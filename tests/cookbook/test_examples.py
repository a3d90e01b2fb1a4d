"""The examples/ scripts, unmodified, against a live tiny-qwen3 server (the quickstart: tests/api/test_quickstart.py)."""

from __future__ import annotations

import re

import pytest
from older_sdk import older_sdk_env


def test_rl_toy_reward_improves_and_sampler_matches_trainer(run_example) -> None:
    out = run_example("rl_toy_reward.py")
    rewards = [float(x) for x in re.findall(r"^step \d+: mean reward (\S+) \(", out, re.M)]
    gaps = [float(x) for x in re.findall(r"\(sampler-trainer logprob gap (\S+)\)$", out, re.M)]
    assert len(rewards) == 12, out
    assert all(0.0 <= r <= 1.0 for r in rewards), out
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.2, f"the reward did not improve: {rewards}"
    assert gaps and all(abs(g) < 1e-4 for g in gaps), f"sampler and trainer logprobs disagree: {gaps}"


def test_multi_tenant_adapters_train_concurrently_and_stay_isolated(run_example) -> None:
    out = run_example("multi_tenant.py")
    assert "every tenant answers with its own name: True" in out, out
    for name in ("alice", "bob", "carol"):
        losses = [float(x) for x in re.findall(rf"^\[ *{name}\] step +\d+: loss +(\S+),", out, re.M)]
        assert len(losses) == 4 and losses[-1] < losses[0], f"{name}: {losses}\n{out}"
    assert re.search(r"none of the names: True$", out, re.M), out


def test_sample_from_checkpoint_in_a_new_process(run_example) -> None:
    out = run_example("sample_from_checkpoint.py")
    assert re.search(r"^saved sampler checkpoint: tinker://[^/\s]+/sampler_weights/pig-latin-final$", out, re.M), out
    assert "same completions in both processes: True" in out, out
    assert "checkpoint differs from the base model: True" in out, out
    losses = [float(x) for x in re.findall(r"^step \d+: loss (\S+)$", out, re.M)]
    assert losses and losses[-1] < 0.5 * losses[0], out


def test_sample_from_checkpoint_with_tinker_0_25(run_example, client_env) -> None:
    """The same script with tinker 0.25.0, the SDK other open servers pin (tests/support/older_sdk.py)."""
    out = run_example("sample_from_checkpoint.py", STEPS="10", **older_sdk_env(client_env))
    assert re.search(r"^saved sampler checkpoint: tinker://[^/\s]+/sampler_weights/pig-latin-final$", out, re.M), out
    assert "same completions in both processes: True" in out, out


@pytest.mark.cookbook_full
def test_rl_toy_reward_other_seed(run_example) -> None:
    out = run_example("rl_toy_reward.py", SEED="3")
    rewards = [float(x) for x in re.findall(r"^step \d+: mean reward (\S+)", out, re.M)]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.2, rewards
