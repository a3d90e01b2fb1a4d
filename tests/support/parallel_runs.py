"""What the parallel server tests run through the real SDK: tenants trained on ragged batches and sampled greedily
(optionally killing a rank mid-way), many samples decoding at once, and a `skyrl-tx worker` node process joining a
coordinator."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
from engine_processes import process_state, spawned_children

from skyrl_tx.bench.api import _engine_pid

STEPS = 4
TENANTS = (("a", 4, 1), ("b", 8, 2), ("full", 0, 3))  # name, LoRA rank (0: full fine-tuning), seed


def train_and_sample(url: str, kill_after: tuple[str, int] | None = None, kill: str = "engine",
                     tenants: tuple[tuple[str, int, int], ...] = TENANTS,
                     base_model: str = "tiny-qwen3") -> dict[str, Any]:
    """`tenants` (by default two LoRA tenants, ranks 4 and 8, and a full fine-tune), fixed seeds, train STEPS steps
    on ragged batches, then sample greedily. kill_after (name, step): kill -9 `kill` ("engine" or "worker", the
    engine's first worker rank) after that tenant's step."""
    import tinker
    from tinker import types

    os.environ.update(TINKER_BASE_URL=url, TINKER_API_KEY="tml-dp", TINKER_TELEMETRY="0")
    out: dict[str, Any] = {"losses": {}, "tokens": {}}
    with tinker.ServiceClient() as service:
        clients = {name: service.create_lora_training_client(base_model=base_model, rank=rank, seed=seed).result()
                   for name, rank, seed in tenants}
        for name, client in clients.items():
            losses = []
            for step in range(STEPS):
                # 3 or 5 rows of different lengths: no multiple of the rank count, unequal tokens
                data = [types.Datum(model_input=types.ModelInput.from_ints(list(range(5 + i, 5 + i + n))),
                                    loss_fn_inputs={"target_tokens": list(range(6 + i, 6 + i + n)),
                                                    "weights": [1.0] * n})
                        for i, n in enumerate([9, 4, 13, 6, 2][: 3 + 2 * (step % 2)])]
                losses.append(client.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
                lr = 1e-3 if name == "full" else 1e-2
                client.optim_step(types.AdamParams(learning_rate=lr)).result()
                if kill_after == (name, step):
                    engine = _engine_pid(url)
                    workers = spawned_children(engine)
                    assert workers, "the parallel engine has no worker rank"
                    os.kill(engine if kill == "engine" else workers[0], signal.SIGKILL)
                    deadline = time.monotonic() + 30
                    while kill == "engine" and any(os.path.exists(f"/proc/{w}") and process_state(w) != "Z"
                                                   for w in workers):
                        assert time.monotonic() < deadline, "the worker rank outlived its engine"
                        time.sleep(0.2)
            out["losses"][name] = losses
            sampler = client.save_weights_and_get_sampling_client().result()
            result = sampler.sample(types.ModelInput.from_ints([5, 6, 7, 8]), 1,
                                    types.SamplingParams(max_tokens=12, temperature=0.0)).result()
            out["tokens"][name] = list(result.sequences[0].tokens)
    return out


def assert_same_as_one_process_run(got: dict[str, Any], one_process: dict[str, Any]) -> None:
    """A parallel server's train_and_sample results against a one-process server's: the losses of each tenant of
    this run (each independent of the others) to 1e-5, and its greedy tokens exactly."""
    assert got["losses"], got
    for name, losses in got["losses"].items():
        assert losses == pytest.approx(one_process["losses"][name], rel=1e-5), name
        assert got["tokens"][name] == one_process["tokens"][name], name


def worker_node(port: int, process_id: int, processes: int, world: int, base_model: str = "tiny-qwen3",
                 config: dict[str, Any] | None = None) -> Any:
    import json
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-m", "skyrl_tx.cli", "worker", "--coordinator-address",
                             f"127.0.0.1:{port}", "--num-processes", str(processes), "--process-id", str(process_id),
                             "--base-model", base_model, "--backend-config",
                             json.dumps(config or {"fully_sharded_data_parallel_size": world})],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


PROMPTS = ([5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [3, 4], [20, 21, 22])


def sample_concurrently(url: str) -> dict[str, Any]:
    """One LoRA step (so its snapshot differs from the base model), then every request submitted before any result
    is read (they decode at once): per weights and prompt, greedy with 2 samples and seeded (temperature 1) with 3;
    then two unseeded requests of one prompt."""
    import tinker
    from tinker import types

    os.environ.update(TINKER_BASE_URL=url, TINKER_API_KEY="tml-dp-sampling", TINKER_TELEMETRY="0")
    with tinker.ServiceClient() as service:
        trainer = service.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=1).result()
        datum = types.Datum(model_input=types.ModelInput.from_ints(list(range(5, 14))),
                            loss_fn_inputs={"target_tokens": list(range(6, 15)), "weights": [1.0] * 9})
        trainer.forward_backward([datum], "cross_entropy").result()
        trainer.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        samplers = {"lora": trainer.save_weights_and_get_sampling_client().result(),
                    "base": service.create_sampling_client(base_model="tiny-qwen3").result()}
        futures = {}
        for name, sampler in samplers.items():
            for i, prompt in enumerate(PROMPTS):
                model_input = types.ModelInput.from_ints(prompt)
                futures[f"{name} greedy {i}"] = sampler.sample(model_input, 2, types.SamplingParams(
                    max_tokens=10, temperature=0.0))
                futures[f"{name} seeded {i}"] = sampler.sample(model_input, 3, types.SamplingParams(
                    max_tokens=10, temperature=1.0, seed=100 + i))
        tokens = {key: [list(s.tokens) for s in f.result().sequences] for key, f in futures.items()}
        # Two at once on an idle server: one per replica (each the first unseeded request its replica decodes)
        unseeded = [samplers["base"].sample(types.ModelInput.from_ints(PROMPTS[0]), 1, types.SamplingParams(
            max_tokens=10, temperature=1.0)) for _ in range(2)]
        return {"tokens": tokens, "unseeded": [list(f.result().sequences[0].tokens) for f in unseeded]}
