"""GET /metrics through a live server: it parses as Prometheus text, and what the tinker SDK sends moves its counters
and histograms by exactly that (requests by type and outcome, queue / engine / total latency, HTTP requests by route,
tokens trained and sampled); the engine's gauges (adapter slots) follow a created model."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from live_server import live_server
from prometheus_client.parser import text_string_to_metric_families
from tinker import types

BASE_MODEL = "tiny-qwen3"
MAX_ADAPTERS = 6
WAIT_S = 30.0  # bound on how long a value the test expects may take to show (the engine reports once a second)

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture(scope="module")
def server_options() -> dict[str, Any]:
    return {"backend_config": {"max_lora_adapters": MAX_ADAPTERS}}


def scrape(url: str, path: str = "/metrics") -> Samples:
    response = httpx.get(url + path, timeout=30)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(response.text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum over the samples of `name` whose labels include `labels` (0 if none)."""
    wanted = set(labels.items())
    return sum(v for (n, got), v in samples.items() if n == name and wanted <= got)


def wait_for(url: str, done: Callable[[Samples], bool]) -> Samples:
    """Scrapes until `done` holds (the engine's notification or stats report may land just after the SDK's answer)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        samples = scrape(url)
        if done(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.2)


@contextlib.contextmanager
def sdk_service(url: str) -> Iterator[Any]:
    """A tinker.ServiceClient of a server this test started itself."""
    import tinker

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINKER_BASE_URL", url)
        mp.setenv("TINKER_API_KEY", "tml-test")
        mp.setenv("TINKER_TELEMETRY", "0")
        with tinker.ServiceClient() as service:
            yield service


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})


def test_metrics_parse_and_name_the_families(tinker_env: str) -> None:
    samples = scrape(tinker_env)
    assert "skyrl_tx_queue_depth" in {name for name, _ in scrape(tinker_env, "/api/v1/metrics")}
    names = {name for name, _ in samples}
    for expected in ("skyrl_tx_queue_depth", "skyrl_tx_engine_restarts_total", "skyrl_tx_engine_ready",
                     "skyrl_tx_database_errors_total"):
        assert expected in names, sorted(names)
    assert value(samples, "skyrl_tx_engine_ready") == 1
    assert value(samples, "skyrl_tx_engine_restarts_total") == 0
    assert value(samples, "skyrl_tx_database_errors_total", process="api") == 0
    assert value(samples, "skyrl_tx_queue_depth", type="forward_backward", state="pending") == 0
    # the engine's report arrives within about a second of start-up: slots and KV rows are known
    samples = wait_for(tinker_env, lambda s: value(s, "skyrl_tx_adapter_slots", state="free") > 0)
    assert value(samples, "skyrl_tx_adapter_slots", state="used") + value(
        samples, "skyrl_tx_adapter_slots", state="free") == MAX_ADAPTERS
    assert value(samples, "skyrl_tx_kv_cache_rows", state="free") > 0


def test_counters_move_by_exactly_the_requests_sent(tinker_env: str, service_client: Any) -> None:
    url = tinker_env
    before = wait_for(url, lambda s: value(s, "skyrl_tx_adapter_slots", state="free") > 0)
    used_before = value(before, "skyrl_tx_adapter_slots", state="used")

    training = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=3).result()
    batch = [datum([5, 17, 300, 42, 7, 99, 1000]), datum([11, 12, 13, 14])]
    for _ in range(3):
        training.forward_backward(batch, "cross_entropy").result()
    for _ in range(2):
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    sampler = service_client.create_sampling_client(base_model=BASE_MODEL).result()
    sampled = sampler.sample(types.ModelInput.from_ints([5, 17, 300]), num_samples=2,
                             sampling_params=types.SamplingParams(max_tokens=6, seed=1)).result()

    sent = {"create_model": 1, "forward_backward": 3, "optim_step": 2, "sample": 1}
    trained_tokens = 3 * sum(d.model_input.length for d in batch)
    sampled_tokens = sum(len(s.tokens) for s in sampled.sequences)

    def delta(samples: Samples, name: str, **labels: str) -> float:
        return value(samples, name, **labels) - value(before, name, **labels)

    def arrived(s: Samples) -> bool:
        return (all(delta(s, "skyrl_tx_requests_total", type=t, outcome="ok") >= n for t, n in sent.items())
                and delta(s, "skyrl_tx_tokens_sampled_total") >= sampled_tokens
                and value(s, "skyrl_tx_adapter_slots", state="used") > used_before)

    after = wait_for(url, arrived)
    for request_type, n in sent.items():
        assert delta(after, "skyrl_tx_requests_total", type=request_type, outcome="ok") == n, request_type
        for outcome in ("user_error", "server_error"):
            assert delta(after, "skyrl_tx_requests_total", type=request_type, outcome=outcome) == 0
        for phase in ("queue", "engine", "total"):
            assert delta(after, "skyrl_tx_request_latency_seconds_count", type=request_type, phase=phase) == n
        assert delta(after, "skyrl_tx_request_latency_seconds_sum", type=request_type, phase="total") >= delta(
            after, "skyrl_tx_request_latency_seconds_sum", type=request_type, phase="engine")
    routes = {"/api/v1/forward_backward": 3, "/api/v1/optim_step": 2, "/api/v1/asample": 1}
    for route, n in routes.items():
        assert delta(after, "skyrl_tx_http_requests_total", method="POST", route=route, status="200") == n, route
        assert delta(after, "skyrl_tx_http_request_duration_seconds_count", method="POST", route=route) == n
    assert delta(after, "skyrl_tx_tokens_trained_total") == trained_tokens
    assert delta(after, "skyrl_tx_tokens_sampled_total") == sampled_tokens
    assert value(after, "skyrl_tx_adapter_slots", state="used") == used_before + 1
    assert value(after, "skyrl_tx_adapter_slots", state="free") == MAX_ADAPTERS - used_before - 1
    assert value(after, "skyrl_tx_queue_depth", type="forward_backward", state="pending") == 0
    assert delta(after, "skyrl_tx_database_errors_total", process="api") == 0
    assert delta(after, "skyrl_tx_database_errors_total", process="engine") == 0



def test_the_hot_path_waits_on_no_poll_interval(tinker_env: str, service_client: Any) -> None:
    """Issue 42's guard, by count instead of by time: a training loop (forward_backward and optim_step pipelined, as
    the quickstart sends them) and samples are picked up by the engine's wake-up and answered by its notification.
    No request waits out the engine's idle poll interval, and no long poll finds its result by a database recheck
    (either would be a missed wake-up: a 50 ms to 1 s stall). The periodic sweeps run beside the loop."""
    url = tinker_env
    before = wait_for(url, lambda s: True)
    training = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=5).result()
    batch = [datum([5, 17, 300, 42, 7, 99, 1000]), datum([11, 12, 13, 14])]
    steps = 20
    for _ in range(steps):
        forward_backward = training.forward_backward(batch, "cross_entropy")
        optim = training.optim_step(types.AdamParams(learning_rate=1e-3))
        forward_backward.result()
        optim.result()
    sampler = service_client.create_sampling_client(base_model=BASE_MODEL).result()
    for seed in range(4):
        sampler.sample(types.ModelInput.from_ints([5, 17, 300]), num_samples=1,
                       sampling_params=types.SamplingParams(max_tokens=4, seed=seed)).result()
    trained = steps * sum(d.model_input.length for d in batch)

    def delta(samples: Samples, name: str) -> float:
        return value(samples, name) - value(before, name)

    after = wait_for(url, lambda s: delta(s, "skyrl_tx_tokens_trained_total") >= trained)  # a report after the loop
    assert delta(after, "skyrl_tx_engine_missed_wakeups_total") == 0
    assert delta(after, "skyrl_tx_long_poll_missed_wakeups_total") == 0


def test_an_engine_restart_is_counted_and_totals_stay_monotonic(preset_cache: Any) -> None:
    """kill -9 of the engine: the restart counter moves by one, the new engine's report rebuilds the slot gauge from
    the models it recovered, and tokens trained before the kill are not lost from the total."""
    with live_server(backend_config={"max_lora_adapters": MAX_ADAPTERS}) as url:
        with sdk_service(url) as service:
            training = service.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=9).result()
            batch = [datum([5, 17, 300, 42, 7])]
            training.forward_backward(batch, "cross_entropy").result()
            before = wait_for(url, lambda s: value(s, "skyrl_tx_tokens_trained_total") == 4
                              and value(s, "skyrl_tx_adapter_slots", state="used") == 1)
            assert value(before, "skyrl_tx_tokens_trained_total") == 4
            assert value(before, "skyrl_tx_engine_restarts_total") == 0

            pid = httpx.get(url + "/api/v1/healthz").json()["engine_pid"]
            os.kill(pid, signal.SIGKILL)
            started = value(before, "skyrl_tx_engine_start_time_seconds")
            assert started > 0
            after = wait_for(url, lambda s: value(s, "skyrl_tx_engine_start_time_seconds") > started
                             and value(s, "skyrl_tx_adapter_slots", state="used") == 1)  # the new engine's report
            assert value(after, "skyrl_tx_engine_start_time_seconds") > started
            assert value(after, "skyrl_tx_engine_restarts_total") == 1
            assert httpx.get(url + "/api/v1/healthz").json()["engine_pid"] != pid
            # the model was rebuilt by replaying its forward_backward, which is not counted again; the new
            # engine's tokens add to the total from before the kill
            assert value(after, "skyrl_tx_tokens_trained_total") == 4
            training.forward_backward(batch, "cross_entropy").result()
            final = wait_for(url, lambda s: value(s, "skyrl_tx_tokens_trained_total") >= 8)
            assert value(final, "skyrl_tx_tokens_trained_total") == 8
            assert value(final, "skyrl_tx_requests_total", type="forward_backward", outcome="ok") == 2
            assert value(final, "skyrl_tx_adapter_slots", state="used") == 1


def test_queue_depth_and_database_errors_read_the_database(tmp_path: Any) -> None:
    """Against a real migrated database: queue depth counts unfinished requests by type and state; a failing
    statement counts as a database error, a duplicate insert (an idempotent retry's path) does not."""
    from prometheus_client import generate_latest
    from sqlalchemy import text
    from sqlalchemy.exc import IntegrityError, OperationalError

    from skyrl_tx.api.metrics import Metrics
    from skyrl_tx.db import future_queries, migrate
    from skyrl_tx.db.session import make_engine

    url = f"sqlite:///{tmp_path / 'metrics.sqlite'}"
    migrate.upgrade(url)
    database = make_engine(url)
    metrics = Metrics(database)

    def row(id_: str, request_type: str, status: str) -> dict[str, Any]:
        return {"id": id_, "request_type": request_type, "request": {}, "request_hash": "h", "status": status}

    with database.begin() as db:
        db.execute(future_queries.INSERT_FUTURE, [row("a", "forward_backward", "pending"),
                                                  row("b", "forward_backward", "pending"),
                                                  row("c", "sample", "running"), row("d", "optim_step", "completed")])

    def samples() -> Samples:
        return {(s.name, frozenset(s.labels.items())): s.value
                for f in text_string_to_metric_families(generate_latest(metrics.registry).decode()) for s in f.samples}

    got = samples()
    assert value(got, "skyrl_tx_queue_depth", type="forward_backward", state="pending") == 2
    assert value(got, "skyrl_tx_queue_depth", type="sample", state="running") == 1
    assert value(got, "skyrl_tx_queue_depth", type="optim_step") == 0
    assert value(got, "skyrl_tx_database_errors_total", process="api") == 0

    with pytest.raises(IntegrityError), database.begin() as db:
        db.execute(future_queries.INSERT_FUTURE, row("a", "forward_backward", "pending"))
    assert value(samples(), "skyrl_tx_database_errors_total", process="api") == 0
    with pytest.raises(OperationalError), database.connect() as db:
        db.execute(text("SELECT * FROM no_such_table"))
    assert value(samples(), "skyrl_tx_database_errors_total", process="api") == 1
    database.dispose()


def test_an_engine_thread_reports_too(preset_cache: Any) -> None:
    """--engine thread: the engine's stats and finished requests reach /metrics without a pipe."""
    with live_server(backend_config={"max_lora_adapters": MAX_ADAPTERS}, extra_args=["--engine", "thread"]) as url:
        with sdk_service(url) as service:
            service.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=2).result()
            samples = wait_for(url, lambda s: value(s, "skyrl_tx_adapter_slots", state="used") == 1
                               and value(s, "skyrl_tx_requests_total", type="create_model") == 1)
        assert value(samples, "skyrl_tx_adapter_slots", state="used") == 1
        assert value(samples, "skyrl_tx_adapter_slots", state="free") == MAX_ADAPTERS - 1
        assert value(samples, "skyrl_tx_requests_total", type="create_model", outcome="ok") == 1
        assert value(samples, "skyrl_tx_request_latency_seconds_count", type="create_model", phase="engine") == 1
