"""Checkpoints through the real SDK, RestClient and `tinker` CLI: exact resume, PEFT/HF exports, listing, delete."""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import tinker
import torch
import sdk_training
from client_scripts import client_argv, exited_cleanly
from hf_reference import hf_token_logprobs, load_hf_model
from sdk_training import TOKENS, server_logprobs
from tinker import types

from skyrl_tx.checkpoints.merge import merge_adapter

ADAM = types.AdamParams(learning_rate=1e-2)
RESUME_STEPS = 3


def train_step(client: tinker.TrainingClient, step: int) -> float:
    return sdk_training.train_step(client, step, ADAM)


def download(rest: tinker.RestClient, tinker_path: str, dest: Path) -> Path:
    return sdk_training.download(rest.get_external_weights_urls(tinker_path).result().urls, dest)


@pytest.fixture(scope="module")
def trained(service_client) -> tinker.TrainingClient:
    client = service_client.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=3).result()
    for step in range(2):
        train_step(client, step)
    return client


def test_resume_with_optimizer_is_exact_and_without_differs(service_client, trained) -> None:
    client = service_client.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=5).result()
    for step in range(2):
        train_step(client, step)
    path = client.save_state("resume_point").result().path
    assert path == f"tinker://{client.model_id}/weights/resume_point"
    expected = [train_step(client, 10 + k) for k in range(RESUME_STEPS)]

    resumed = service_client.create_training_client_from_state_with_optimizer(path).result()
    assert resumed.model_id != client.model_id
    assert [train_step(resumed, 10 + k) for k in range(RESUME_STEPS)] == pytest.approx(expected, rel=1e-5, abs=1e-5)

    weights_only = service_client.create_training_client_from_state(path).result()
    without = [train_step(weights_only, 10 + k) for k in range(RESUME_STEPS)]
    assert without[0] == pytest.approx(expected[0], rel=1e-5)  # same weights: the first loss agrees
    assert abs(without[-1] - expected[-1]) > 1e-3  # fresh AdamW moments: the trajectory differs


def test_load_into_a_model_that_trained_is_refused(service_client, trained) -> None:
    path = trained.save_state("refuse_me").result().path
    with pytest.raises(Exception, match="already trained"):
        trained.load_state(path).result()


def test_external_export_loads_in_peft_and_merged_hf(service_client, trained, tinker_env, tiny_model_dir,
                                                     tmp_path) -> None:
    from peft import PeftModel

    rest = tinker.RestClient(base_url=tinker_env)
    path = trained.save_weights_external("export").result().path
    adapter_dir = download(rest, path, tmp_path / "adapter")
    assert json.loads((adapter_dir / "adapter_config.json").read_text())["r"] == 4
    tokens = TOKENS[:20]
    expected = server_logprobs(trained, tokens)

    base_dir = tiny_model_dir("tiny-qwen3")
    peft_model = PeftModel.from_pretrained(load_hf_model(base_dir), str(adapter_dir)).eval()
    torch.testing.assert_close(hf_token_logprobs(peft_model, tokens), expected, atol=1e-4, rtol=0)

    merged_dir = tmp_path / "merged"
    assert len(merge_adapter(base_dir, adapter_dir, merged_dir)) > 0
    torch.testing.assert_close(hf_token_logprobs(load_hf_model(merged_dir), tokens), expected, atol=1e-4, rtol=0)


def test_sampler_checkpoint_samples_from_another_session(service_client, trained, tinker_env) -> None:
    path = trained.save_weights_for_sampler("for_sampling").result().path
    assert path == f"tinker://{trained.model_id}/sampler_weights/for_sampling"
    params = types.SamplingParams(max_tokens=6, temperature=0.0)
    prompt = types.ModelInput.from_ints(TOKENS[:6])
    here = service_client.create_sampling_client(model_path=path).result().sample(prompt, 1, params).result()
    with tinker.ServiceClient() as other_session:
        there = other_session.create_sampling_client(model_path=path).result().sample(prompt, 1, params).result()
    assert len(here.sequences[0].tokens) == 6
    assert there.sequences[0].tokens == here.sequences[0].tokens


def test_list_info_delete_and_bare_id(service_client, trained, tinker_env) -> None:
    rest = tinker.RestClient(base_url=tinker_env)
    state = trained.save_state("listed").result().path
    sampler = trained.save_weights_for_sampler("listed_sampler").result().path
    ids = {c.checkpoint_id: c for c in rest.list_checkpoints(trained.model_id).result().checkpoints}
    assert {"weights/listed", "sampler_weights/listed_sampler"} <= set(ids)
    assert ids["weights/listed"].checkpoint_type == "training" and ids["weights/listed"].size_bytes > 0
    assert state in {c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints}

    info = rest.get_weights_info_by_tinker_path(state).result()
    assert (info.base_model, info.is_lora, info.lora_rank) == ("tiny-qwen3", True, 4)
    run = rest.get_training_run_by_tinker_path(state).result()
    assert run.training_run_id == trained.model_id and run.is_lora and run.last_checkpoint is not None
    assert trained.model_id in {r.training_run_id for r in rest.list_training_runs(limit=100).result().training_runs}

    with pytest.raises(tinker.BadRequestError, match="weights/listed"):
        rest.delete_checkpoint(trained.model_id, "listed").result()  # a bare id: which kind?
    rest.delete_checkpoint_from_tinker_path(sampler).result()
    remaining = {c.checkpoint_id for c in rest.list_checkpoints(trained.model_id).result().checkpoints}
    assert "sampler_weights/listed_sampler" not in remaining and "weights/listed" in remaining
    with pytest.raises(Exception, match="not found"):
        service_client.create_sampling_client(model_path=sampler).result().sample(
            types.ModelInput.from_ints(TOKENS[:4]), 1, types.SamplingParams(max_tokens=2)).result()


def test_deleted_checkpoint_leaves_storage(service_client, trained, tinker_env) -> None:
    rest = tinker.RestClient(base_url=tinker_env)
    path = trained.save_weights_external("to_delete").result().path
    urls = rest.get_external_weights_urls(path).result().urls
    rest.delete_checkpoint_from_tinker_path(path).result()
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(next(iter(urls.values())))
    assert err.value.code == 404


def test_tinker_cli_lists_runs_and_checkpoints_and_downloads(service_client, trained, tinker_env, tmp_path) -> None:
    path = trained.save_state("cli").result().path
    cli = client_argv("-m", "tinker.cli.__main__", "-f", "json")

    def run(*args: str) -> str:
        # The CLI is an SDK client: its exit can meet the SDK transport's known abort at interpreter finalization,
        # after its complete output (tests/support/client_scripts.py); exited_cleanly tells that from a failure.
        result = subprocess.run([*cli, *args], capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert exited_cleanly(result.returncode, result.stderr), \
            f"tinker {' '.join(args)}: exit {result.returncode}\n{result.stdout}\n{result.stderr[-3000:]}"
        return result.stdout

    assert trained.model_id in run("run", "list")
    assert path in run("checkpoint", "list", "--run-id", trained.model_id)
    run("checkpoint", "download", path, "--output", str(tmp_path / "out"))
    downloaded = list((tmp_path / "out").rglob("adapter_model.safetensors"))
    assert len(downloaded) == 1, list((tmp_path / "out").rglob("*"))
