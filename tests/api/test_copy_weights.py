"""copy_weights through the SDK (RestClient.copy_weights, ServiceClient.copy_weights) on a server with API keys: a
copy of a training or sampler checkpoint lands in a new run of the caller's, in the named project, serves the same
weights and outlives its source; only readable checkpoints (own or published) are copied; a retry with the same
idempotency key returns the same copy; a copy that fails is never listed and leaves no files; bad requests get a
400 naming the field."""

from __future__ import annotations

import shutil
import uuid
from concurrent.futures import ThreadPoolExecutor
import warnings
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import tinker
from keyed_server import keyed_server, service_clients, status_of
from live_server import ServerUrl
from sdk_training import server_logprobs, train_step
from tinker import types

KEYS = {"alice": {}, "bob": {}}
ADAM = types.AdamParams(learning_rate=2e-2)
PROMPT = [5, 17, 300, 42, 7, 99]


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def server_url(request: pytest.FixtureRequest, preset_cache) -> Iterator[ServerUrl]:
    with keyed_server(request.param, KEYS, backend_config={"max_lora_adapters": 6}) as url:
        yield url


@pytest.fixture(scope="module")
def clients(server_url: ServerUrl) -> Iterator[dict[str, tinker.ServiceClient]]:
    with service_clients(server_url, project_id="proj-archive") as by_key:
        yield by_key


@pytest.fixture(scope="module")
def alice(clients: dict[str, tinker.ServiceClient]) -> dict[str, Any]:
    """Alice's trained model with a training checkpoint and sampler weights."""
    training = clients["alice"].create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=1).result()
    for step in range(2):
        train_step(training, step, ADAM)
    return {"training": training, "weights": training.save_state("w1").result().path,
            "sampler": training.save_weights_for_sampler("s1").result().path,
            "logprobs": server_logprobs(training, PROMPT)}


def rest(server_url: ServerUrl, name: str) -> tinker.RestClient:
    return tinker.RestClient(base_url=server_url, api_key=server_url.keys[name])


def post_copy(server_url: ServerUrl, name: str, body: dict[str, Any], key: str | None = None) -> httpx.Response:
    headers = {"X-API-Key": server_url.keys[name], **({"X-Idempotency-Key": key} if key else {})}
    return httpx.post(f"{server_url}/api/v1/copy_weights", headers=headers, json=body, timeout=60)


def listed(server_url: ServerUrl, name: str) -> dict[str, types.Checkpoint]:
    return {c.tinker_path: c for c in rest(server_url, name).list_user_checkpoints(limit=1000).result().checkpoints}


def sampled_logprobs(client: tinker.ServiceClient, path: str) -> list[float]:
    sampler = client.create_sampling_client(model_path=path).result()
    return sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result()[1:]


def test_a_sampler_checkpoint_copy_serves_the_same_weights_in_a_new_run(server_url: ServerUrl, clients: Any,
                                                                          alice: dict[str, Any]) -> None:
    copy = rest(server_url, "alice").copy_weights(alice["sampler"], "proj-archive").result()
    assert copy != alice["sampler"] and copy.endswith("/sampler_weights/s1")
    run_id = copy.removeprefix("tinker://").split("/")[0]
    assert run_id != alice["training"].model_id
    assert sampled_logprobs(clients["alice"], copy) == pytest.approx(alice["logprobs"].tolist(), abs=1e-5)
    checkpoints = listed(server_url, "alice")
    assert checkpoints[copy].size_bytes == checkpoints[alice["sampler"]].size_bytes
    assert checkpoints[copy].expires_at is None
    run = rest(server_url, "alice").get_training_run(run_id).result()
    assert (run.base_model, run.lora_rank, run.user_metadata) == ("tiny-qwen3", 4, {"copied_from": alice["sampler"]})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # experimental
        found = rest(server_url, "alice").search_sessions(types.SessionSearchRequest(
            session_id=run_id.split(":")[0])).result().sessions
    assert [(s.project_id, s.checkpoints_count) for s in found] == [("proj-archive", 1)]
    # The copy's run holds weights only: nothing trains it.
    response = httpx.post(f"{server_url}/api/v1/get_info", headers={"X-API-Key": server_url.keys["alice"]},
                          json={"model_id": run_id})
    assert response.status_code == 404


def test_a_training_checkpoint_copy_resumes_and_outlives_its_source(server_url: ServerUrl, clients: Any,
                                                                    alice: dict[str, Any]) -> None:
    source = alice["training"].save_state("w-doomed").result().path
    copy = clients["alice"].copy_weights(source, ttl_seconds=7200).result()  # ServiceClient: its own project
    assert listed(server_url, "alice")[copy].expires_at is not None
    rest(server_url, "alice").delete_checkpoint_from_tinker_path(source).result()
    assert source not in listed(server_url, "alice")
    resumed = clients["alice"].create_training_client_from_state_with_optimizer(copy).result()
    assert server_logprobs(resumed, PROMPT).tolist() == pytest.approx(alice["logprobs"].tolist(), abs=1e-5)
    # the same next step from the copy and from the original: the optimizer state was copied too
    assert train_step(resumed, 5, ADAM) == pytest.approx(train_step(alice["training"], 5, ADAM), rel=1e-5)


def test_only_readable_checkpoints_are_copied_and_copies_belong_to_the_caller(server_url: ServerUrl,
                                                                              alice: dict[str, Any]) -> None:
    assert status_of(lambda: rest(server_url, "bob").copy_weights(alice["sampler"], "mine").result()) == 404
    rest(server_url, "alice").publish_checkpoint_from_tinker_path(alice["sampler"]).result()
    try:
        copy = rest(server_url, "bob").copy_weights(alice["sampler"], "mine").result()
    finally:
        rest(server_url, "alice").unpublish_checkpoint_from_tinker_path(alice["sampler"]).result()
    assert copy in listed(server_url, "bob") and copy not in listed(server_url, "alice")
    assert listed(server_url, "bob")[copy].public is False


def test_a_retry_with_the_same_idempotency_key_returns_the_same_copy(server_url: ServerUrl,
                                                                      alice: dict[str, Any]) -> None:
    key, body = str(uuid.uuid4()), {"source_path": alice["sampler"], "destination_project_id": "proj-archive"}
    first, again = post_copy(server_url, "alice", body, key), post_copy(server_url, "alice", body, key)
    assert first.status_code == again.status_code == 200, first.text
    assert first.json() == again.json()
    other = post_copy(server_url, "alice", body, str(uuid.uuid4()))
    assert other.json()["tinker_path"] != first.json()["tinker_path"]
    assert post_copy(server_url, "bob", body, key).status_code == 404  # Bob's try with Alice's key: his own request
    reused = post_copy(server_url, "alice", {**body, "source_path": alice["weights"]}, key)
    assert reused.status_code == 400 and "X-Idempotency-Key" in reused.json()["message"]


def test_concurrent_tries_of_one_copy_make_one_copy(server_url: ServerUrl, alice: dict[str, Any]) -> None:
    """Tries racing for one idempotency key: each gets the copy or a 409 (which the SDK retries), never a second
    copy."""
    key, body = str(uuid.uuid4()), {"source_path": alice["weights"], "destination_project_id": "proj-race"}
    before = set(listed(server_url, "alice"))
    with ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(lambda _: post_copy(server_url, "alice", body, key), range(6)))
    assert {r.status_code for r in responses} <= {200, 409}, [r.text for r in responses]
    paths = {r.json()["tinker_path"] for r in responses if r.status_code == 200}
    assert len(paths) == 1 and set(listed(server_url, "alice")) - before == paths


def test_a_copy_that_fails_is_never_listed_and_leaves_no_files(server_url: ServerUrl, alice: dict[str, Any]) -> None:
    source = alice["training"].save_weights_for_sampler("s-broken").result().path
    store = server_url.log_path.parent / "checkpoints"
    (source_dir,) = [p for p in store.glob("*/sampler_weights/s-broken")]
    shutil.rmtree(source_dir)  # listed, but its files are gone: the copy fails part-way
    before = set(listed(server_url, "alice"))
    response = post_copy(server_url, "alice", {"source_path": source, "destination_project_id": "p"}, "k-broken")
    assert response.status_code == 404 and "missing" in response.json()["message"], response.text
    assert set(listed(server_url, "alice")) == before
    assert not [p for p in store.rglob("*") if ".partial-" in p.name]
    assert not [p for p in store.glob("*/sampler_weights/s-broken") if p != source_dir]


@pytest.mark.parametrize(("body", "field"), [
    ({"source_path": "tinker://x/weights"}, "source_path"),
    ({"source_path": "s3://bucket/ckpt", "destination_project_id": "p"}, "source_path"),
    ({"ttl_seconds": 60, "destination_project_id": "p"}, "ttl_seconds"),
    ({}, "destination_project_id"),
    ({"session_id": "s"}, "model_seq_id"),
    ({"model_seq_id": 3, "destination_project_id": "p"}, "session_id"),
    ({"session_id": "s", "model_seq_id": 1, "destination_project_id": "p"}, "not both"),
])
def test_bad_requests_name_the_field(server_url: ServerUrl, alice: dict[str, Any], body: dict[str, Any],
                                     field: str) -> None:
    response = post_copy(server_url, "alice", {"source_path": alice["sampler"], **body})
    assert response.status_code == 400, response.text
    assert field in response.json()["message"], response.text
