"""Idempotent submits over raw HTTP (httpx), as the SDK's retries send them: the same request again gets the same
request_id and runs once; the same id with another body is a 409.

forward_backward bodies are built with the SDK's own protobuf encoder (tinker.proto.request_conv), exactly as
tinker/resources/training.py puts them on the wire.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from tinker import types
from tinker.proto import request_conv

BASE_MODEL = "tiny-qwen3"
HEADERS = {"X-API-Key": "tml-test"}
PROTOBUF = "application/x-protobuf"
ADAM = {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0, "grad_clip_norm": 0.0}


@pytest.fixture
def http(server_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server_url, headers=HEADERS, timeout=60) as client:
        yield client


def wait(http: httpx.Client, request_id: str, accept: str = "application/json", timeout_s: float = 120) -> httpx.Response:
    """retrieve_future until the answer is not try_again."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = http.post("/api/v1/retrieve_future", json={"request_id": request_id, "allow_metadata_only": False},
                      headers={"Accept": accept})
        assert r.status_code == 200, r.text
        if r.headers["content-type"].startswith("application/json") and r.json().get("type") == "try_again":
            continue
        return r
    raise AssertionError(f"future {request_id} did not finish in {timeout_s} s")


def result(http: httpx.Client, request_id: str) -> dict[str, Any]:
    body = wait(http, request_id).json()
    assert "error" not in body, body
    return body


def create_session(http: httpx.Client) -> str:
    r = http.post("/api/v1/create_session", json={"tags": [], "user_metadata": {}, "sdk_version": "0.38.0",
                                                  "type": "create_session"})
    assert r.status_code == 200, r.text
    return r.json()["session_id"]


def create_model_body(session_id: str, model_seq_id: int, rank: int = 4, seed: int = 1) -> dict[str, Any]:
    return {"session_id": session_id, "model_seq_id": model_seq_id, "base_model": BASE_MODEL,
            "lora_config": {"rank": rank, "seed": seed, "train_unembed": True, "train_mlp": True, "train_attn": True},
            "optimizer_config": {"type": "adamw"}, "type": "create_model"}


def create_model(http: httpx.Client, session_id: str, model_seq_id: int, seed: int = 1) -> str:
    r = http.post("/api/v1/create_model", json=create_model_body(session_id, model_seq_id, seed=seed))
    assert r.status_code == 200, r.text
    assert result(http, r.json()["request_id"])["model_id"] == r.json()["model_id"]
    return r.json()["model_id"]


def fb_body(model_id: str, seq_id: int, tokens: list[int]) -> bytes:
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy"),
        model_id=model_id, seq_id=seq_id)
    return request_conv.forward_backward_request_to_proto(request).SerializeToString()


def post_fb(http: httpx.Client, model_id: str, seq_id: int, tokens: list[int]) -> httpx.Response:
    return http.post("/api/v1/forward_backward", content=fb_body(model_id, seq_id, tokens),
                     headers={"Content-Type": PROTOBUF})


def optim_body(model_id: str, seq_id: int, **adam: float) -> dict[str, Any]:
    return {"model_id": model_id, "seq_id": seq_id, "adam_params": {**ADAM, **adam}, "type": "optim_step"}


def post_optim(http: httpx.Client, model_id: str, seq_id: int, **adam: float) -> httpx.Response:
    return http.post("/api/v1/optim_step", json=optim_body(model_id, seq_id, **adam))


TOKENS = [5, 17, 300, 42, 7, 99]


def test_create_model_twice_is_one_model(http: httpx.Client) -> None:
    session_id = create_session(http)
    body = create_model_body(session_id, 0)
    first, second = http.post("/api/v1/create_model", json=body), http.post("/api/v1/create_model", json=body)
    assert first.status_code == second.status_code == 200, (first.text, second.text)
    assert first.json()["request_id"] == second.json()["request_id"]
    assert first.json()["model_id"] == second.json()["model_id"] == f"{session_id}:train:0"
    assert result(http, first.json()["request_id"]) == {"model_id": f"{session_id}:train:0"}
    # a retry after completion still answers with the same future
    third = http.post("/api/v1/create_model", json=body)
    assert third.status_code == 200 and third.json()["request_id"] == first.json()["request_id"]
    info = http.post("/api/v1/get_info", json={"model_id": f"{session_id}:train:0", "type": "get_info"})
    assert info.status_code == 200 and info.json()["lora_rank"] == 4
    # the same model_seq_id with another body is a conflict, not a second model
    other = http.post("/api/v1/create_model", json=create_model_body(session_id, 0, rank=8))
    assert other.status_code == 409, other.text
    assert "different body" in other.json()["message"]


def test_concurrent_duplicate_create_model(http: httpx.Client, server_url: str) -> None:
    session_id = create_session(http)
    body = create_model_body(session_id, 0)

    def send(_: int) -> httpx.Response:
        with httpx.Client(base_url=server_url, headers=HEADERS, timeout=60) as client:
            return client.post("/api/v1/create_model", json=body)

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(send, range(4)))
    assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
    assert len({a.json()["request_id"] for a in answers}) == 1
    assert result(http, answers[0].json()["request_id"])["model_id"] == f"{session_id}:train:0"


def test_repeated_optim_step_runs_once(http: httpx.Client) -> None:
    session_id = create_session(http)
    model_id = create_model(http, session_id, 0)
    fb = post_fb(http, model_id, 1, TOKENS)
    assert fb.status_code == 200, fb.text

    first, again = post_optim(http, model_id, 2), post_optim(http, model_id, 2)
    assert first.status_code == again.status_code == 200, (first.text, again.text)
    assert first.json()["request_id"] == again.json()["request_id"]
    step1 = result(http, first.json()["request_id"])["metrics"]
    assert step1["step"] == 1 and step1["grad_norm"] > 0
    # resent after it completed: still the same future, still not run again
    late = post_optim(http, model_id, 2)
    assert late.status_code == 200 and late.json()["request_id"] == first.json()["request_id"]
    assert result(http, late.json()["request_id"])["metrics"] == step1

    following = post_optim(http, model_id, 3)
    assert following.status_code == 200, following.text
    assert result(http, following.json()["request_id"])["metrics"]["step"] == 2  # not 3: seq 2 ran once


def test_same_seq_id_with_another_body_is_409(http: httpx.Client) -> None:
    session_id = create_session(http)
    model_id = create_model(http, session_id, 0)
    ok = post_optim(http, model_id, 1)
    assert ok.status_code == 200, ok.text
    conflict = post_optim(http, model_id, 1, learning_rate=0.5)
    assert conflict.status_code == 409, conflict.text
    assert conflict.headers["content-type"].startswith("application/json")
    assert "seq_id" in conflict.json()["message"]
    # another request type on a used seq_id is a conflict too
    other_kind = post_fb(http, model_id, 1, TOKENS)
    assert other_kind.status_code == 409, other_kind.text
    assert result(http, ok.json()["request_id"])["metrics"]["step"] == 1


def test_repeated_forward_backward_accumulates_once(http: httpx.Client) -> None:
    """A resent forward_backward must not add its gradient twice: the following optim_step's grad_norm equals
    that of a twin model (same seed) that got the request once."""
    session_id = create_session(http)
    twice, once = create_model(http, session_id, 0, seed=3), create_model(http, session_id, 1, seed=3)
    first, again = post_fb(http, twice, 1, TOKENS), post_fb(http, twice, 1, TOKENS)
    assert first.status_code == again.status_code == 200, (first.text, again.text)
    assert first.json()["request_id"] == again.json()["request_id"]
    assert post_fb(http, once, 1, TOKENS).status_code == 200
    norms = []
    for model_id in (twice, once):
        r = post_optim(http, model_id, 2)
        assert r.status_code == 200, r.text
        norms.append(result(http, r.json()["request_id"])["metrics"]["grad_norm"])
    assert norms[0] > 0
    assert norms[0] == pytest.approx(norms[1], rel=1e-6)


def test_concurrent_duplicate_optim_steps_run_once(http: httpx.Client, server_url: str) -> None:
    session_id = create_session(http)
    model_id = create_model(http, session_id, 0)

    def send(_: int) -> httpx.Response:
        with httpx.Client(base_url=server_url, headers=HEADERS, timeout=60) as client:
            return post_optim(client, model_id, 1)

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(send, range(4)))
    assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
    assert len({a.json()["request_id"] for a in answers}) == 1
    assert result(http, answers[0].json()["request_id"])["metrics"]["step"] == 1
    following = post_optim(http, model_id, 2)
    assert result(http, following.json()["request_id"])["metrics"]["step"] == 2


def test_requests_run_in_seq_id_order_even_if_they_arrive_out_of_order(http: httpx.Client) -> None:
    session_id = create_session(http)
    model_id = create_model(http, session_id, 0)
    step = post_optim(http, model_id, 2)  # arrives first
    assert step.status_code == 200, step.text
    time.sleep(1.0)  # let the engine see it alone
    assert post_fb(http, model_id, 1, TOKENS).status_code == 200
    metrics = result(http, step.json()["request_id"])["metrics"]
    assert metrics["grad_norm"] > 0, f"optim_step (seq 2) ran before forward_backward (seq 1): {metrics}"
