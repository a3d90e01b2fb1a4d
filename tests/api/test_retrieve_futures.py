"""retrieve_futures (SDK 0.38's one long poll per sampling client) through the real SDK and on the wire, on a server
started with --sample-retrieve-futures: concurrent samples, sync and async, return exactly what the per-request
retrieve_future poll returns; each completion is reported once per cursor, again for an older cursor; the poll
answers at its deadline; bad bodies are 4xx."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
from tinker import types

from skyrl_tx.api.routes.futures_batch import MAX_RETRIEVED_IDS

BASE_MODEL = "tiny-qwen3"
CONCURRENT = 24
GREEDY = types.SamplingParams(max_tokens=6, temperature=0.0)


def prompts() -> list[types.ModelInput]:
    return [types.ModelInput.from_ints([5 + i, 17, 300 + 7 * i, 42, 7 + i]) for i in range(CONCURRENT)]


def as_values(response: types.SampleResponse) -> list[tuple[list[int], list[float] | None]]:
    return [(list(s.tokens), s.logprobs) for s in response.sequences]


def assert_same(results: list[Any], expected: list[Any]) -> None:
    """Same tokens; the same logprobs up to float32 rounding (which samples share a decode batch differs from run
    to run, and a batched matmul may round the last bit differently)."""
    assert [[tokens for tokens, _ in r] for r in results] == [[tokens for tokens, _ in r] for r in expected]
    for result, reference in zip(results, expected):
        for (_, logprobs), (_, reference_logprobs) in zip(result, reference):
            assert logprobs == pytest.approx(reference_logprobs, rel=1e-5, abs=1e-5)


def polls_logged(server_url: Any) -> int:
    """retrieve_futures calls in the server's access log."""
    return Path(server_url.log_path).read_text(errors="replace").count("/api/v1/retrieve_futures")


@pytest.fixture(scope="module")
def per_request_results(tinker_env: str) -> list[Any]:
    """The same samples polled one by one with retrieve_future: the SDK's path when the server leaves
    sample_use_retrieve_futures off (set off in this client only)."""
    with tinker.ServiceClient() as service:
        holder = service.holder
        holder._client_config = holder._client_config.model_copy(update={"sample_use_retrieve_futures": False})
        sampler = service.create_sampling_client(base_model=BASE_MODEL).result()
        futures = [sampler.sample(p, 2, GREEDY) for p in prompts()]
        return [as_values(f.result(timeout=120)) for f in futures]


@pytest.fixture(scope="module")
def server_options() -> dict[str, Any]:
    return {"extra_args": ["--sample-retrieve-futures"]}  # off by default (skyrl_tx/config.py says why)


@pytest.fixture(scope="module")
def service_client(tinker_env: str) -> Iterator[Any]:
    """The module's SDK client, closed with a bounded wait: with the retrieve_futures poll on, the SDK's close hangs
    now and then (skyrl_tx/config.py says how). The session then ends at the server's session timeout."""
    client = tinker.ServiceClient()
    try:
        yield client
    finally:
        with contextlib.suppress(TimeoutError, concurrent.futures.TimeoutError):
            client.close("success").result(timeout=30)


def test_the_server_asks_for_retrieve_futures(http: httpx.Client) -> None:
    config = http.post("/api/v1/client/config", json={}).json()
    assert config["sample_use_retrieve_futures"] is True


def test_concurrent_samples_equal_the_per_request_poll(service_client: Any, server_url: Any,
                                                       per_request_results: list[Any]) -> None:
    before = polls_logged(server_url)
    sampler = service_client.create_sampling_client(base_model=BASE_MODEL).result()
    futures = [sampler.sample(p, 2, GREEDY) for p in prompts()]  # all in flight at once
    results = [as_values(f.result(timeout=120)) for f in futures]
    assert_same(results, per_request_results)
    assert all(tokens for result in results for tokens, _ in result)
    assert polls_logged(server_url) > before  # they did go through retrieve_futures


def test_concurrent_async_samples_equal_the_per_request_poll(service_client: Any,
                                                             per_request_results: list[Any]) -> None:
    sampler = service_client.create_sampling_client(base_model=BASE_MODEL).result()

    async def run() -> list[Any]:
        responses = await asyncio.gather(*(sampler.sample(p, 2, GREEDY).coroutine() for p in prompts()))
        return [as_values(r) for r in responses]

    assert_same(asyncio.run(run()), per_request_results)


# ---- on the wire ---------------------------------------------------------------------------------------------------
def sampler_id(http: httpx.Client, session_seq: int) -> str:
    session = http.post("/api/v1/create_session", json={}).json()["session_id"]
    return http.post("/api/v1/create_sampling_session", json={
        "session_id": session, "sampling_session_seq_id": session_seq, "base_model": BASE_MODEL}).json()[
        "sampling_session_id"]


def asample(http: httpx.Client, sampler: str, seq_id: int) -> str:
    r = http.post("/api/v1/asample", json={"sampling_session_id": sampler, "seq_id": seq_id, "num_samples": 1,
                                           "prompt": {"chunks": [{"tokens": [5, 6, 7]}]},
                                           "sampling_params": {"max_tokens": 2, "temperature": 0.0}})
    assert r.status_code == 200, r.text
    return r.json()["request_id"]


def poll(http: httpx.Client, sampler: str, prev_cursor: int = 0, clone: int = 0, **extra: Any) -> dict[str, Any]:
    r = http.post("/api/v1/retrieve_futures", json={
        "target": {"type": "sampling_session", "sampling_session_id": sampler, "cloned_sampler_id": clone},
        "prev_cursor": prev_cursor, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def poll_until(http: httpx.Client, sampler: str, count: int, clone: int = 0) -> tuple[list[dict[str, Any]], int]:
    """Long polls from cursor 0 on, as the SDK does, until `count` completions came; each is reported once."""
    seen: list[dict[str, Any]] = []
    cursor = 0
    deadline = time.monotonic() + 120
    while len(seen) < count and time.monotonic() < deadline:
        answer = poll(http, sampler, cursor, clone)
        seen += answer["completions"]
        assert answer["cursor"] >= cursor
        cursor = answer["cursor"]
    return seen, cursor


def test_each_completion_is_reported_once_per_cursor_and_again_for_an_older_one(http: httpx.Client) -> None:
    sampler = sampler_id(http, 0)
    assert poll(http, sampler, timeout=0) == {"completions": [], "cursor": 0}
    ids = [asample(http, sampler, seq) for seq in range(3)]
    clone_id = asample(http, sampler, 3 * 1_000_000_000)  # cloned sampler 3: its own queue
    seen, cursor = poll_until(http, sampler, 3)
    assert sorted(c["request_id"] for c in seen) == sorted(ids)
    assert all(c["state"] == "finished" for c in seen)
    assert poll(http, sampler, cursor, timeout=0) == {"completions": [], "cursor": cursor}  # nothing new
    # A response the client never got is answered again, in the same order, for the cursor it still holds.
    assert poll(http, sampler, 0, timeout=0) == {"completions": seen, "cursor": cursor}
    assert [c["request_id"] for c in poll_until(http, sampler, 1, clone=3)[0]] == [clone_id]
    # Every reported sample's result is fetched with retrieve_future as before.
    for future_id in ids:
        result = http.post("/api/v1/retrieve_future", json={"request_id": future_id}).json()
        assert len(result["sequences"][0]["tokens"]) == 2, result


def test_a_poll_with_nothing_to_report_answers_at_its_deadline(http: httpx.Client) -> None:
    sampler = sampler_id(http, 0)
    started = time.monotonic()
    assert poll(http, sampler, timeout=1.0) == {"completions": [], "cursor": 0}  # bounded: the client's timeout
    waited = time.monotonic() - started
    assert waited >= 1.0  # held to its deadline, not answered at once: a busy machine only makes this longer


def test_a_cursor_the_server_never_gave_still_sees_new_completions(http: httpx.Client) -> None:
    """A client that kept its cursor across a database reset (or a retention sweep of the queue's newest rows)."""
    sampler = sampler_id(http, 0)
    future_id = asample(http, sampler, 0)
    answer = poll(http, sampler, 10**6, timeout=30)
    assert [c["request_id"] for c in answer["completions"]] == [future_id] and answer["cursor"] > 10**6


def test_malformed_bodies_are_400_naming_the_field(http: httpx.Client) -> None:
    sampler = sampler_id(http, 0)
    target = {"type": "sampling_session", "sampling_session_id": sampler}
    cases = {
        "target": {"prev_cursor": 0},
        "target.type": {"target": {**target, "type": "model"}},
        "prev_cursor": {"target": target, "prev_cursor": -1},
        "target.cloned_sampler_id": {"target": {**target, "cloned_sampler_id": 2**62}},
        "timeout": {"target": target, "timeout": -1},
        "retrieved_request_ids": {"target": target, "retrieved_request_ids": ["x"] * (MAX_RETRIEVED_IDS + 1)},
    }
    for field, body in cases.items():
        r = http.post("/api/v1/retrieve_futures", json=body)
        assert r.status_code == 400 and field in r.json()["message"], (field, r.status_code, r.text)
    r = http.post("/api/v1/retrieve_futures", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    r = http.post("/api/v1/retrieve_futures", json={"target": {**target, "sampling_session_id": "nope:sample:0"}})
    assert r.status_code == 404 and "not found" in r.json()["message"], r.text
    assert http.post("/api/v1/cancel_future", json={}).status_code == 400
    assert http.post("/api/v1/cancel_future", json={"request_id": 5}).status_code == 400
    r = http.post("/api/v1/cancel_future", json={"request_id": "nope:0"})
    assert r.status_code == 404 and "not found" in r.json()["message"], r.text


def test_cancel_of_a_finished_sample_leaves_it_be(http: httpx.Client) -> None:
    sampler = sampler_id(http, 0)
    future_id = asample(http, sampler, 0)
    poll_until(http, sampler, 1)
    answer = http.post("/api/v1/cancel_future", json={"request_id": future_id}).json()
    assert answer["cancelled"] is False and answer["status"] == "completed", answer
    assert "already finished" in answer["message"]
    assert "sequences" in http.post("/api/v1/retrieve_future", json={"request_id": future_id}).json()
