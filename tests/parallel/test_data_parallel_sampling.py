"""Colocated sampling shared by the data-parallel replicas (parallel/sampling_share.py), on the DP=2 backend itself:
the removal rule, streaming from rank 1, one process's results. Through the SDK against a live DP=2 server:
tests/parallel/test_data_parallel_server.py (test_data_parallel_server_equals_one_process)."""

from __future__ import annotations

from typing import Any

import pytest


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
