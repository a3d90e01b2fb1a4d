"""Load through the real SDK: 64 clients (32 training, 32 sampling) with 512 requests in flight at once, mixed
training and sampling, on SQLite and PostgreSQL. Every request completes, none is lost, run twice or reordered."""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import tinker
from tinker import types

from sdk_training import datum

SERVICES = 4  # sessions; each holds 8 training and 8 sampling clients
TRAINERS_PER_SERVICE = SAMPLERS_PER_SERVICE = 8
IN_FLIGHT_PER_CLIENT = 8  # 64 clients x 8 = 512 requests submitted before any result is read
ADAM = types.AdamParams(learning_rate=1e-3)


@pytest.fixture(scope="module")
def server_options() -> dict[str, Any]:
    return {"backend_config": {"max_lora_adapters": SERVICES * TRAINERS_PER_SERVICE, "max_sampling_sequences": 64}}


def _timed(future: Any, submitted: float) -> tuple[Any, float]:
    return future.result(timeout=600), time.monotonic() - submitted


def test_64_clients_with_512_requests_in_flight(tinker_env: str) -> None:
    services = [tinker.ServiceClient() for _ in range(SERVICES)]
    try:
        trainers = [s.create_lora_training_client(base_model="tiny-qwen3", rank=4).result()
                    for s in services for _ in range(TRAINERS_PER_SERVICE)]
        samplers = [s.create_sampling_client(base_model="tiny-qwen3").result()
                    for s in services for _ in range(SAMPLERS_PER_SERVICE)]
        params = types.SamplingParams(max_tokens=8, temperature=1.0)
        submitted: list[tuple[str, Any, float]] = []
        for i, trainer in enumerate(trainers):  # forward_backward, optim_step, ... pipelined, nothing awaited
            for k in range(IN_FLIGHT_PER_CLIENT):
                call = trainer.forward_backward([datum(i + k)], "cross_entropy") if k % 2 == 0 else trainer.optim_step(ADAM)
                submitted.append(("fb" if k % 2 == 0 else "step", call, time.monotonic()))
        for sampler in samplers:
            for k in range(IN_FLIGHT_PER_CLIENT):
                call = sampler.sample(types.ModelInput.from_ints([5, 6, 7, k + 8]), 1, params)
                submitted.append(("sample", call, time.monotonic()))
        assert len(submitted) == 512
        with ThreadPoolExecutor(32) as pool:
            outcomes = list(pool.map(lambda s: (s[0], *_timed(s[1], s[2])), submitted))
    finally:
        for s in services:
            s.close("success").result()
    latencies = sorted(latency for _, _, latency in outcomes)
    print(f"\n512 requests: p50 {statistics.median(latencies):.2f} s, "
          f"p99 {latencies[int(0.99 * (len(latencies) - 1))]:.2f} s, max {latencies[-1]:.2f} s")
    steps = [result for kind, result, _ in outcomes if kind == "step"]
    # Each trainer's optim_steps saw the AdamW step counter 1, 2, 3, 4 in order: none lost, repeated or reordered.
    for t in range(len(trainers)):
        counters = [steps[t * IN_FLIGHT_PER_CLIENT // 2 + k].metrics["step"] for k in range(IN_FLIGHT_PER_CLIENT // 2)]
        assert counters == [1.0, 2.0, 3.0, 4.0], counters
        grads = [steps[t * IN_FLIGHT_PER_CLIENT // 2 + k].metrics["grad_norm"] for k in range(IN_FLIGHT_PER_CLIENT // 2)]
        assert all(g > 0 for g in grads), grads  # every step followed its own forward_backward
    for kind, result, _ in outcomes:
        if kind == "fb":
            assert len(result.loss_fn_outputs) == 1
        elif kind == "sample":
            assert len(result.sequences) == 1 and 1 <= len(result.sequences[0].tokens) <= 8
