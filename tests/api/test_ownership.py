"""Per-key isolation through the real SDK: key B gets 404 for everything of key A's (train, forward, sample, poll,
cancel, a sampling session's completions, list/delete/download/TTL checkpoints, load or sample A's tinker:// paths,
A's session); A's published checkpoint is readable by B and still writable only by A; an admin key sees
everything."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import tinker
from keyed_server import keyed_server, service_clients, status_of
from live_server import ServerUrl
from sdk_training import datum
from tinker import types

ADAM = types.AdamParams(learning_rate=1e-2)
KEYS = {"alice": {}, "bob": {}, "root": {"admin": True}}


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def server_url(request: pytest.FixtureRequest, preset_cache) -> Iterator[ServerUrl]:
    with keyed_server(request.param, KEYS, backend_config={"max_lora_adapters": 6}) as url:
        yield url


@pytest.fixture(scope="module")
def clients(server_url: ServerUrl) -> Iterator[dict[str, tinker.ServiceClient]]:
    with service_clients(server_url) as by_key:
        yield by_key


@pytest.fixture(scope="module")
def alice(clients: dict[str, tinker.ServiceClient]) -> dict[str, Any]:
    """Alice's objects: a trained model, a training checkpoint, sampler weights, a sampling client."""
    training = clients["alice"].create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=1).result()
    training.forward_backward([datum(0)], "cross_entropy").result()
    training.optim_step(ADAM).result()
    weights = training.save_state("w1").result().path
    sampler_path = training.save_weights_for_sampler("s1").result().path
    external = training.save_weights_external("e1").result().path
    sampler = clients["alice"].create_sampling_client(model_path=sampler_path).result()
    return {"training": training, "weights": weights, "sampler_path": sampler_path, "sampler": sampler,
            "external": external,
            "model_id": training.model_id, "session_id": training.model_id.split(":")[0]}


def rest_client(server_url: ServerUrl, name: str) -> tinker.RestClient:
    return tinker.RestClient(base_url=server_url, api_key=server_url.keys[name])


def raw(server_url: ServerUrl, name: str) -> httpx.Client:
    return httpx.Client(base_url=server_url, headers={"X-API-Key": server_url.keys[name]}, timeout=60)


PROMPT = types.ModelInput.from_ints([5, 6, 7])
PARAMS = types.SamplingParams(max_tokens=2, seed=0)


def test_another_key_gets_404_for_everything_of_alices(server_url, clients, alice) -> None:
    bob = clients["bob"]
    model_id, weights, sampler_path = alice["model_id"], alice["weights"], alice["sampler_path"]
    # Alice's model addressed through Bob's connection: every training call is "not found".
    as_bob = tinker.TrainingClient(bob.holder, 0, model_id, info=alice["training"].get_info())
    assert status_of(lambda: as_bob.forward_backward([datum(1)], "cross_entropy").result()) == 404
    assert status_of(lambda: as_bob.forward([datum(1)], "cross_entropy").result()) == 404
    assert status_of(lambda: as_bob.optim_step(ADAM).result()) == 404
    assert status_of(lambda: as_bob.save_state("stolen").result()) == 404
    assert status_of(lambda: as_bob.save_weights_for_sampler("stolen").result()) == 404
    # Alice's sampling session, and her tinker:// paths.
    bob_sampler = tinker.SamplingClient(bob.holder, sampling_session_id=alice["sampler"]._sampling_session_id,
                                        base_model="tiny-qwen3")
    assert status_of(lambda: bob_sampler.sample(PROMPT, 1, PARAMS).result()) == 404
    assert status_of(lambda: bob.create_sampling_client(model_path=sampler_path).result()) \
        == 404
    assert status_of(lambda: bob.create_training_client_from_state(weights).result()) == 404
    assert status_of(lambda: bob.create_training_client_from_state_with_optimizer(weights).result()) == 404
    # The RestClient: runs, checkpoints (list, delete, TTL, download URLs, publish, info), samplers.
    rest = rest_client(server_url, "bob")
    assert status_of(lambda: rest.get_training_run(model_id).result()) == 404
    assert status_of(lambda: rest.list_checkpoints(model_id).result()) == 404
    assert status_of(lambda: rest.get_external_weights_urls(alice["external"]).result()) == 404
    assert status_of(lambda: rest.delete_checkpoint_from_tinker_path(weights).result()) == 404
    assert status_of(lambda: rest.set_checkpoint_ttl_from_tinker_path(weights, 7200).result()) == 404
    assert status_of(lambda: rest.publish_checkpoint_from_tinker_path(weights).result()) == 404
    assert status_of(lambda: rest.get_weights_info_by_tinker_path(weights).result()) == 404
    assert status_of(lambda: rest.get_sampler(alice["sampler"]._sampling_session_id).result()) == 404
    assert model_id not in [r.training_run_id for r in rest.list_training_runs().result().training_runs]
    assert weights not in [c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints]
    # What the SDK cannot address: Alice's futures, her session, her model by id.
    with raw(server_url, "bob") as http:
        session = alice["session_id"]
        for path, body in [("retrieve_future", {"request_id": f"{model_id}:create"}),
                           ("session_heartbeat", {"session_id": session}),
                           ("get_info", {"model_id": model_id}), ("unload_model", {"model_id": model_id}),
                           ("create_model", {"session_id": session, "model_seq_id": 7, "base_model": "tiny-qwen3",
                                             "lora_config": {"rank": 4}}),
                           ("create_sampling_session", {"session_id": session, "sampling_session_seq_id": 7,
                                                        "base_model": "tiny-qwen3"}),
                           ("load_weights", {"model_id": model_id, "seq_id": 99, "path": weights}),
                           ("cancel_future", {"request_id": f"{model_id}:create"}),
                           ("retrieve_futures", {"timeout": 0, "target": {
                               "type": "sampling_session",
                               "sampling_session_id": alice["sampler"]._sampling_session_id}}),
                           (f"sessions/{session}/finish", {})]:
            response = http.post(f"/api/v1/{path}", json=body)
            assert response.status_code == 404, (path, response.text)
            assert "not found" in response.json()["message"]
    # Alice's objects are untouched: she trains on, her checkpoint is listed, her sampler samples.
    alice["training"].forward_backward([datum(2)], "cross_entropy").result()
    alice["training"].optim_step(ADAM).result()
    alice_rest = rest_client(server_url, "alice")
    assert weights in [c.tinker_path for c in alice_rest.list_checkpoints(model_id).result().checkpoints]
    assert len(alice["sampler"].sample(PROMPT, 1, PARAMS).result().sequences) == 1


def test_a_published_checkpoint_is_readable_by_every_key_and_writable_only_by_its_owner(server_url, clients,
                                                                                         alice) -> None:
    bob, weights, sampler_path = clients["bob"], alice["weights"], alice["sampler_path"]
    alice_rest, bob_rest = rest_client(server_url, "alice"), rest_client(server_url, "bob")
    alice_rest.publish_checkpoint_from_tinker_path(weights).result()
    alice_rest.publish_checkpoint_from_tinker_path(sampler_path).result()
    alice_rest.publish_checkpoint_from_tinker_path(alice["external"]).result()
    try:
        assert [c.public for c in alice_rest.list_checkpoints(alice["model_id"]).result().checkpoints] == [True] * 3
        loaded = bob.create_training_client_from_state(weights).result()  # Bob's own model, from Alice's weights
        loaded.forward_backward([datum(3)], "cross_entropy").result()
        bob_sampler = bob.create_sampling_client(model_path=sampler_path).result()
        assert len(bob_sampler.sample(PROMPT, 1, PARAMS).result().sequences) == 1
        bob_urls = bob_rest.get_external_weights_urls(alice["external"]).result().urls
        bob_url = next(iter(bob_urls.values()))
        assert httpx.get(bob_url, timeout=60).status_code == 200
        assert bob_rest.get_weights_info_by_tinker_path(weights).result().lora_rank == 4
        # Readable is not writable: Bob cannot delete, expire or unpublish it, nor list Alice's run.
        assert status_of(lambda: bob_rest.delete_checkpoint_from_tinker_path(weights).result()) == 404
        assert status_of(lambda: bob_rest.set_checkpoint_ttl_from_tinker_path(weights, 7200).result()) == 404
        assert status_of(lambda: bob_rest.unpublish_checkpoint_from_tinker_path(weights).result()) == 404
        assert status_of(lambda: bob_rest.list_checkpoints(alice["model_id"]).result()) == 404
        # Unpublished again, the URLs Bob was given stop working before they expire; Alice's own still work.
        alice_rest.unpublish_checkpoint_from_tinker_path(alice["external"]).result()
        assert httpx.get(bob_url, timeout=60).status_code == 404
        alice_url = next(iter(alice_rest.get_external_weights_urls(alice["external"]).result().urls.values()))
        assert httpx.get(alice_url, timeout=60).status_code == 200
    finally:
        alice_rest.unpublish_checkpoint_from_tinker_path(weights).result()
        alice_rest.unpublish_checkpoint_from_tinker_path(sampler_path).result()
        alice_rest.unpublish_checkpoint_from_tinker_path(alice["external"]).result()
    assert status_of(lambda: bob.create_training_client_from_state(weights).result()) == 404  # private again


def test_an_admin_key_sees_every_keys_objects(server_url, clients, alice) -> None:
    root = rest_client(server_url, "root")
    runs = [r.training_run_id for r in root.list_training_runs(limit=100).result().training_runs]
    assert alice["model_id"] in runs
    assert root.get_training_run(alice["model_id"]).result().model_owner.startswith("key-")
    assert alice["weights"] in [c.tinker_path for c in root.list_checkpoints(alice["model_id"]).result().checkpoints]
    assert clients["root"].create_training_client_from_state(alice["weights"]).result().model_id


def test_training_runs_list_only_the_callers_runs(server_url, clients, alice) -> None:
    bob = clients["bob"]
    own = bob.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=2).result()
    listed = rest_client(server_url, "bob").list_training_runs(limit=100).result()
    runs = [r.training_run_id for r in listed.training_runs]
    assert own.model_id in runs and alice["model_id"] not in runs
    assert listed.cursor.total_count == len(runs)
