"""chat_sl (supervised.train) on the cookbook's bundled conversations: SFT, periodic + final checkpoints, resume."""

from __future__ import annotations

import importlib.resources
import math
from pathlib import Path

import pytest

MODULE = "tinker_cookbook.recipes.chat_sl.train"


@pytest.fixture(scope="module")
def conversations(cookbook_installed: None) -> Path:
    path = Path(str(importlib.resources.files("tinker_cookbook") / "example_data" / "conversations.jsonl"))
    assert path.is_file(), path
    return path


def chat_sl_args(model_dir: Path, dataset: Path, renderer: str = "role_colon", **overrides: object) -> list[str]:
    args = {"model_name": model_dir, "renderer_name": renderer, "dataset": dataset, "batch_size": 16,
            "max_length": 512, "lora_rank": 8, "learning_rate": 1e-2, "save_every": 2, "eval_every": 0,
            "max_steps": 4, **overrides}
    return [f"{k}={v}" for k, v in args.items()]


def test_chat_sl_trains_saves_and_resumes(run_recipe, rest, model_dir: Path, conversations: Path,
                                          tmp_path: Path) -> None:
    log_path = tmp_path / "chat_sl"
    first = run_recipe(MODULE, *chat_sl_args(model_dir, conversations), log_path=log_path)
    first.assert_finite()
    nll = first.series("train_mean_nll")
    assert len(nll) == 4, first.metrics
    assert nll[0] == pytest.approx(math.log(2112), abs=0.5), nll  # random init: about ln(vocab)
    assert nll[-1] < nll[0] - 0.5, f"training loss did not fall: {nll}"

    # Checkpoints: periodic (step 2) and final, both kinds, as recorded and as the server lists them.
    records = first.checkpoints
    assert [r["name"] for r in records] == ["000002", "final"], records
    for record in records:
        assert record["state_path"].endswith(f"/weights/{record['name']}"), record
        assert record["sampler_path"].endswith(f"/sampler_weights/{record['name']}"), record
    run_id = records[0]["state_path"].removeprefix("tinker://").split("/", 1)[0]
    listed = {c.tinker_path for c in rest.list_checkpoints(run_id).result().checkpoints}
    assert {r[k] for r in records for k in ("state_path", "sampler_path")} <= listed, listed
    run = rest.get_training_run_by_tinker_path(records[-1]["state_path"]).result()
    assert run.user_metadata and run.user_metadata.get("renderer_name") == "role_colon", run
    assert run.is_lora and run.lora_rank == 8, run

    # A run that stopped after its step-2 checkpoint: resume from it (weights and optimizer state).
    (log_path / "checkpoints.jsonl").write_text((log_path / "checkpoints.jsonl").read_text().splitlines()[0] + "\n")
    resumed = run_recipe(MODULE, *chat_sl_args(model_dir, conversations), "behavior_if_log_dir_exists=resume",
                         log_path=log_path)
    assert f"Resumed training from {records[0]['state_path']}" in resumed.output, resumed.tail()
    resumed.assert_finite()
    rows = resumed.metrics[len(nll):]
    assert [round(r["progress"], 2) for r in rows] == [0.75, 1.0], rows  # batches 2 and 3 again, not 0 and 1
    # The restored weights are trained ones: far below the from-scratch loss on the same batch.
    assert rows[0]["train_mean_nll"] < nll[0] - 0.5, (rows, nll)
    names = [r["name"] for r in resumed.checkpoints]
    assert names[-1] == "final" and len(names) == 3, names
    new_run = resumed.checkpoints[-1]["state_path"].removeprefix("tinker://").split("/", 1)[0]
    assert new_run != run_id  # resuming creates a new training run from the saved state
    listed = {c.tinker_path for c in rest.list_checkpoints(new_run).result().checkpoints}
    assert resumed.checkpoints[-1]["state_path"] in listed, listed


@pytest.mark.cookbook_full
def test_chat_sl_qwen3_renderer(run_recipe, model_dir: Path, conversations: Path) -> None:
    """The qwen3 renderer (<|im_start|>/<|im_end|> special tokens) with the tiny preset's tokenizer."""
    run = run_recipe(MODULE, *chat_sl_args(model_dir, conversations, renderer="qwen3", save_every=0))
    run.assert_finite()
    nll = run.series("train_mean_nll")
    assert nll[-1] < nll[0] - 0.5, nll
    assert "<|im_start|>" in run.output  # the recipe logs a rendered example


@pytest.mark.cookbook_full
def test_chat_sl_rolling_checkpoints(run_recipe, rest, model_dir: Path, conversations: Path) -> None:
    """The upstream rolling-checkpoint test: rolling (state only) + periodic (both) + one final record."""
    run = run_recipe(MODULE, *chat_sl_args(model_dir, conversations, save_every=2, max_steps=4),
                     "rolling_save_every=1", "rolling_ttl_seconds=3600")
    records = run.checkpoints
    rolling = [r for r in records if r.get("rolling")]
    periodic = [r for r in records if not r.get("rolling") and r["name"] != "final"]
    assert rolling and all("state_path" in r and "sampler_path" not in r for r in rolling), records
    assert periodic and all("state_path" in r and "sampler_path" in r for r in periodic), records
    assert [r["name"] for r in records].count("final") == 1, records
    # Every rolling checkpoint but the newest was deleted through the REST API; finals and periodic ones stay.
    run_id = records[-1]["state_path"].removeprefix("tinker://").split("/", 1)[0]
    listed = {c.tinker_path for c in rest.list_checkpoints(run_id).result().checkpoints}
    assert all(r["state_path"] in listed for r in periodic + [records[-1]]), (records, listed)
    assert sum(r["state_path"] in listed for r in rolling) <= 1, (records, listed)
