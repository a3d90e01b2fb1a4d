"""A request the API rejects at its edge after reading its model and seq_id still consumes that seq_id: it is stored
as a failed future (category user, the 400's message), so the engine, which never skips a missing seq_id, runs the
model's later requests at once. The client still gets the 4xx; a retry gets the same 4xx."""

from __future__ import annotations

import socket
import sqlite3
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
from tinker import types

from sdk_training import token_datum as datum
from tinker.proto import request_conv
from raw_futures import retrieve

BASE_MODEL = "tiny-qwen3"
PROTOBUF = "application/x-protobuf"
ADAM = {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0, "grad_clip_norm": 0.0}
TIMEOUT_S = 60  # far below the session timeout a skipped-over gap would wait for


@pytest.fixture(scope="module")
def server_options() -> dict[str, Any]:
    return {"backend_config": {"max_lora_adapters": 16}}  # a model per test case




GOOD = [datum([5, 17, 300, 42, 7])]


def fb_body(model_id: str, seq_id: int, data: list[types.Datum]) -> bytes:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
        model_id=model_id, seq_id=seq_id)
    return request_conv.forward_backward_request_to_proto(request).SerializeToString()



def stored_row(server_url: Any, future_id: str) -> tuple | None:
    """(status, model_id, seq_id, completed_at, error) of the future, read from the server's SQLite file."""
    with sqlite3.connect(Path(server_url.log_path).parent / "skyrl_tx.db") as db:
        return db.execute("SELECT status, model_id, seq_id, completed_at, error FROM futures WHERE id = ?",
                          (future_id,)).fetchone()


def test_sdk_client_goes_on_after_a_rejected_request(service_client: Any) -> None:
    """The SDK counted the rejected forward_backward's seq_id: its next requests must not wait for it."""
    client = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=1).result()
    with pytest.raises(tinker.BadRequestError, match="weights"):
        client.forward_backward([datum([5, 6, 7, 8], weights=[1.0, float("nan"), 1.0])], "cross_entropy").result()
    with pytest.raises(tinker.BadRequestError, match="eps"):
        client.optim_step(types.AdamParams(eps=0.0)).result()
    fb = client.forward_backward(GOOD, "cross_entropy").result(timeout=TIMEOUT_S)
    assert fb.metrics["loss:sum"] > 0
    assert client.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=TIMEOUT_S).metrics["grad_norm"] > 0


def test_rejected_request_is_a_failed_future_and_idempotent(service_client: Any, server_url: Any,
                                                            http: httpx.Client) -> None:
    model_id = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=2).result().model_id
    bad = {"model_id": model_id, "seq_id": 1, "adam_params": {**ADAM, "eps": 0.0}}
    first = http.post("/api/v1/optim_step", json=bad)
    assert first.status_code == 400 and "eps" in first.json()["message"], first.text
    assert retrieve(http, f"{model_id}:1") == {"error": first.json()["message"], "category": "user"}
    again = http.post("/api/v1/optim_step", json=bad)  # a retry: the same answer, nothing new stored
    assert (again.status_code, again.json()) == (400, first.json())
    # the seq_id is taken: a different request under it is a conflict, not a second request 1
    other = http.post("/api/v1/optim_step", json={**bad, "adam_params": ADAM})
    assert other.status_code == 409, other.text
    if (Path(server_url.log_path).parent / "skyrl_tx.db").exists():  # the SQLite run: read the row itself
        status, row_model, row_seq, completed_at, _ = stored_row(server_url, f"{model_id}:1")
        assert (status, row_model, row_seq) == ("failed", model_id, 1) and completed_at is not None
    # seq_ids 2 and 3 run at once: nothing waits for 1
    fb = http.post("/api/v1/forward_backward", content=fb_body(model_id, 2, GOOD), headers={"Content-Type": PROTOBUF})
    step = http.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": 3, "adam_params": ADAM})
    assert "loss_fn_outputs" in retrieve(http, fb.json()["request_id"])
    assert retrieve(http, step.json()["request_id"])["metrics"]["grad_norm"] > 0


@pytest.mark.parametrize(("route", "body", "status", "fragment"), [
    # a body that fails schema validation before the route runs
    ("optim_step", {"adam_params": {"learning_rate": "fast"}}, 400, "learning_rate"),
    # forward_backward: protobuf, checked in its route
    ("forward_backward", {"data": []}, 400, "no datums"),
    ("save_weights", {"path": "../escape"}, 400, "checkpoint name"),
    ("save_weights_for_sampler", {}, 400, "path"),
    ("load_weights", {"path": "tinker://no-such-run/weights/never"}, 404, "never"),
])
def test_every_sequenced_route_consumes_the_seq_id(service_client: Any, http: httpx.Client, route: str,
                                                   body: dict, status: int, fragment: str) -> None:
    model_id = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=3).result().model_id
    if route == "forward_backward":
        r = http.post("/api/v1/forward_backward", content=fb_body(model_id, 1, body["data"]),
                      headers={"Content-Type": PROTOBUF})
    else:
        r = http.post(f"/api/v1/{route}", json={"model_id": model_id, "seq_id": 1, **body})
    assert r.status_code == status and fragment in r.json()["message"], r.text
    assert retrieve(http, f"{model_id}:1") == {"error": r.json()["message"], "category": "user"}
    fb = http.post("/api/v1/forward_backward", content=fb_body(model_id, 2, GOOD), headers={"Content-Type": PROTOBUF})
    assert "loss_fn_outputs" in retrieve(http, fb.json()["request_id"])


def test_nothing_is_stored_for_an_unknown_model_or_an_invalid_seq_id(service_client: Any, http: httpx.Client) -> None:
    r = http.post("/api/v1/optim_step", json={"model_id": "nosession:train:0", "seq_id": 1,
                                              "adam_params": {**ADAM, "eps": 0.0}})
    assert r.status_code == 404, r.text
    assert http.post("/api/v1/retrieve_future", json={"request_id": "nosession:train:0:1"}).status_code == 404
    model_id = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=4).result().model_id
    r = http.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": -5, "adam_params": ADAM})
    assert r.status_code == 400 and "seq_id" in r.json()["message"], r.text
    assert http.post("/api/v1/retrieve_future", json={"request_id": f"{model_id}:-5"}).status_code == 404


def test_an_undecodable_forward_backward_consumes_its_seq_id(service_client: Any, http: httpx.Client) -> None:
    """The body's first fields name the model and seq_id; what follows is not usable (an image chunk)."""
    from skyrl_tx.wire import tinker_wire_pb2 as pb

    model_id = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=5).result().model_id
    message = pb.ForwardBackwardRequest(model_id=model_id, seq_id=1, loss_fn="cross_entropy")
    message.data.add().model_input.add().image.format = "png"
    r = http.post("/api/v1/forward_backward", content=message.SerializeToString(), headers={"Content-Type": PROTOBUF})
    assert r.status_code == 400 and "image" in r.json()["message"], r.text
    assert retrieve(http, f"{model_id}:1") == {"error": r.json()["message"], "category": "user"}
    fb = http.post("/api/v1/forward_backward", content=fb_body(model_id, 2, GOOD), headers={"Content-Type": PROTOBUF})
    assert "loss_fn_outputs" in retrieve(http, fb.json()["request_id"])


def test_a_forward_backward_over_the_size_limit_consumes_its_seq_id(service_client: Any, server_url: str,
                                                                  http: httpx.Client) -> None:
    """Announced larger than the limit: the 413 comes before the body is read, but its first bytes (sent with the
    headers, as the SDK does) still name the model and seq_id."""
    model_id = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=6).result().model_id
    body = fb_body(model_id, 1, [datum(list(range(5, 2005)))] * 64)  # ~0.5 MB of the start of a huge batch
    host, port = server_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(b"POST /api/v1/forward_backward HTTP/1.1\r\nHost: test\r\nContent-Type: application/x-protobuf\r\n"
                     b"Content-Length: 300000000\r\n\r\n" + body)
        head = sock.recv(65536).decode("latin-1")
    assert head.startswith("HTTP/1.1 413"), head[:200]
    failed = retrieve(http, f"{model_id}:1")
    assert failed["category"] == "user" and "exceeds the limit" in failed["error"], failed
    fb = http.post("/api/v1/forward_backward", content=fb_body(model_id, 2, GOOD), headers={"Content-Type": PROTOBUF})
    assert "loss_fn_outputs" in retrieve(http, fb.json()["request_id"])
