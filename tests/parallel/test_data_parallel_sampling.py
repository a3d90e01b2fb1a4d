"""Through the real tinker SDK: a DP=2 server's colocated sampling runs on both ranks (each data-parallel replica
decodes a share of the requests with its own KV cache) and returns a one-process server's tokens: greedy and seeded,
num_samples > 1, the base model and a trained LoRA snapshot (mirrored to both ranks)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
from live_server import live_server

DP = {"fully_sharded_data_parallel_size": 2}
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


@pytest.fixture(scope="module")
def one_process_samples(preset_cache) -> dict[str, Any]:
    with live_server() as url:
        return sample_concurrently(url)


def test_both_ranks_decode_and_match_one_process(preset_cache, one_process_samples, tmp_path: Path) -> None:
    with live_server(backend_config=DP, data_dir=tmp_path) as url:
        got = sample_concurrently(url)
    log = url.log_tail(100_000)  # read after the stop: each rank says at exit how many sequences it decoded
    assert got["tokens"] == one_process_samples["tokens"]
    assert got["unseeded"][0] != got["unseeded"][1], "two unseeded requests drew the same tokens"
    sequences = sum(len(s) for s in got["tokens"].values()) + len(got["unseeded"])
    worker = re.search(r"rank 1 stops: it decoded (\d+) sampled sequences", log)
    assert worker is not None, log[-4000:]
    per_replica = re.search(r"sequences decoded per replica \[(\d+), (\d+)\]", log)
    assert per_replica is not None, log[-4000:]
    on_rank0, on_rank1 = int(per_replica[1]), int(per_replica[2])
    assert int(worker[1]) == on_rank1 > 0 and on_rank0 > 0, (worker[0], per_replica[0])
    assert on_rank0 + on_rank1 == sequences


def test_weights_a_replica_samples_cannot_be_removed_and_streams_report_from_it(tiny_model_dir, caplog) -> None:
    """The DP=2 backend itself: a snapshot sampled by requests on either replica (queued or decoding) is refused
    removal with ConflictError before any rank changes (without the check, rank 0 would remove it and rank 1 fail
    the request or diverge), streaming progress comes from rank 1 too, and the results equal one process's."""
    from skyrl_tx.backend.model_backend import make_model_backend
    from skyrl_tx.backend.native import NativeBackend
    from skyrl_tx.config import BackendSettings
    from skyrl_tx.errors import ConflictError
    from skyrl_tx.types import SampleRequest, SamplingParams

    model_dir = tiny_model_dir("tiny-qwen3")
    requests = [SampleRequest([5 + i, 6, 7], SamplingParams(max_tokens=8, temperature=1.0, seed=i, stop=[]),
                              num_samples=2, weights_id="m@1", stream=True) for i in range(3)]

    def run(backend: Any) -> tuple[list[Any], dict[int, int]]:
        backend.create_model("m", lora_rank=4, seed=3)
        backend.set_adapter_weights("m", {k: v + 0.05 for k, v in backend.adapter_state_dict("m").items()})
        backend.snapshot("m", "m@1")
        ids = [backend.submit_sample(r) for r in requests]
        with pytest.raises(ConflictError, match="serving running sample requests"):
            backend.remove_snapshot("m@1")  # queued, not yet on any rank
        results: dict[int, Any] = {}
        streamed: dict[int, int] = {}
        while len(results) < len(ids):
            results.update(backend.sample_step())
            for sample_id, tokens in backend.sample_progress([i for i in ids if i not in results]).items():
                streamed[sample_id] = max(streamed.get(sample_id, 0), sum(len(t) for t in tokens))
            if len(results) < len(ids):
                with pytest.raises(ConflictError):
                    backend.remove_snapshot("m@1")  # decoding on a replica
        backend.remove_snapshot("m@1")  # done everywhere: removed on both ranks (a divergence would end the process)
        backend.remove_model("m")
        return [[s.tokens for s in results[i].sequences] for i in ids], streamed

    settings = BackendSettings(max_lora_adapters=2, max_lora_rank=4, max_sampling_sequences=8)
    one, _ = run(NativeBackend(model_dir, settings))
    backend = make_model_backend(model_dir, BackendSettings(**{**settings.__dict__,
                                                              "fully_sharded_data_parallel_size": 2}))
    try:
        got, streamed = run(backend)
    finally:
        with caplog.at_level("INFO", logger="skyrl_tx.parallel"):
            backend.close()
    assert got == one
    assert len(streamed) == len(requests) and all(streamed.values()), streamed  # every request, on either replica
    assert "sequences decoded per replica [4, 2]" in caplog.text, caplog.text  # requests 0, 2 on rank 0; 1 on rank 1
