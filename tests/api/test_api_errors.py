"""Errors as a user meets them: through the tinker SDK (the exception class, category and message it raises),
and over raw HTTP (status, JSON body). The server runs with max_lora_rank 8 and max_sampling_length 64."""

from __future__ import annotations

import socket
from typing import Any

import httpx
import pytest
import tinker
from tinker import types

from sdk_training import token_datum as datum

BASE_MODEL = "tiny-qwen3"
VOCAB_SIZE = 2112


@pytest.fixture(scope="module")
def server_options() -> dict[str, Any]:
    return {"backend_config": {"max_lora_rank": 8, "max_sampling_length": 64}}


@pytest.fixture(scope="module")
def training_client(service_client: Any) -> Any:
    return service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=1).result()


@pytest.fixture(scope="module")
def sampler(service_client: Any) -> Any:
    return service_client.create_sampling_client(base_model=BASE_MODEL).result()




GOOD = [datum([5, 17, 300, 42, 7])]


def user_failure(future: Any) -> tinker.RequestFailedError:
    with pytest.raises(tinker.RequestFailedError) as info:
        future.result()
    assert info.value.category == "user", f"category {info.value.category!r}: {info.value.message}"
    return info.value


def error_json(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json"), response.headers
    body = response.json()
    assert isinstance(body.get("message"), str) and body["message"], body
    return body


# ---- through the SDK -------------------------------------------------------------------------------------------
def test_unserved_base_model_is_a_bad_request(service_client: Any) -> None:
    with pytest.raises(tinker.BadRequestError) as info:
        service_client.create_lora_training_client(base_model="no-such-model/Base-1B", rank=4).result()
    assert "base_model" in str(info.value) and "no-such-model/Base-1B" in str(info.value)
    with pytest.raises(tinker.BadRequestError, match="base_model"):
        service_client.create_sampling_client(base_model="no-such-model/Base-1B").result()


def test_rank_above_max_lora_rank_is_a_bad_request(service_client: Any) -> None:
    with pytest.raises(tinker.BadRequestError) as info:
        service_client.create_lora_training_client(base_model=BASE_MODEL, rank=16).result()
    assert "max_lora_rank" in str(info.value) and "16" in str(info.value)


@pytest.mark.parametrize("bad", [VOCAB_SIZE, 5000, -1])
def test_token_id_outside_the_vocab_is_a_user_error(training_client: Any, bad: int) -> None:
    error = user_failure(training_client.forward_backward([datum([5, bad, 7, 8])], "cross_entropy"))
    assert str(bad) in error.message and "token" in error.message
    error = user_failure(training_client.forward([datum([5, 6, 7, 8], target_tokens=[6, 7, bad])], "cross_entropy"))
    assert str(bad) in error.message and "token" in error.message


def test_unknown_loss_fn_config_key_is_a_user_error(training_client: Any) -> None:
    error = user_failure(training_client.forward_backward(GOOD, "cross_entropy", {"no_such_key": 1.0}))
    assert "no_such_key" in error.message
    error = user_failure(training_client.forward_backward(
        [datum([5, 6, 7, 8], logprobs=[-1.0] * 3, advantages=[1.0] * 3)], "ppo", {"clip_low_treshold": 0.9}))
    assert "clip_low_treshold" in error.message


def test_missing_loss_input_is_a_user_error(training_client: Any) -> None:
    error = user_failure(training_client.forward_backward([datum([5, 6, 7, 8])], "importance_sampling"))
    assert "advantages" in error.message or "logprobs" in error.message


def test_a_failed_request_does_not_poison_the_client(training_client: Any) -> None:
    user_failure(training_client.forward_backward([datum([5, VOCAB_SIZE + 1, 7])], "cross_entropy"))
    fwd = training_client.forward(GOOD, "cross_entropy").result()
    fb = training_client.forward_backward(GOOD, "cross_entropy").result()
    assert fb.metrics["loss:sum"] == pytest.approx(fwd.metrics["loss:sum"], rel=1e-6)
    assert training_client.optim_step(types.AdamParams(learning_rate=1e-3)).result().metrics["grad_norm"] > 0


def test_a_bad_request_fails_alone_in_a_shared_batch(service_client: Any) -> None:
    """Requests of several models share engine passes: one client's bad datum must fail only its own future."""
    good_client = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=2).result()
    bad_client = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=3).result()
    expected = good_client.forward(GOOD, "cross_entropy").result()
    bad_futures, good_futures = [], []
    for _ in range(3):  # forward_backward on both sides: the engine batches requests of one kind together
        bad_futures.append(bad_client.forward_backward([datum([5, VOCAB_SIZE, 7])], "cross_entropy"))
        good_futures.append(good_client.forward_backward(GOOD, "cross_entropy"))
    for bad, good in zip(bad_futures, good_futures):
        user_failure(bad)
        assert good.result().metrics["loss:sum"] == pytest.approx(expected.metrics["loss:sum"], rel=1e-6)
    # the failed passes left no partial gradient behind: the good client stepped equals a twin trained alone
    twin = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=2).result()
    for _ in range(3):
        twin.forward_backward(GOOD, "cross_entropy")
    norms = [c.optim_step(types.AdamParams(learning_rate=1e-3)).result().metrics["grad_norm"] for c in (good_client, twin)]
    assert norms[0] == pytest.approx(norms[1], rel=1e-5)


@pytest.mark.parametrize(("params", "fragment"), [
    ({"temperature": -1.0, "max_tokens": 4}, "temperature"),
    ({"top_p": 1.5, "max_tokens": 4}, "top_p"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 100}, "max_sampling_length"),
])
def test_bad_sampling_params_are_user_errors(sampler: Any, params: dict[str, Any], fragment: str) -> None:
    error = user_failure(sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 1, types.SamplingParams(**params)))
    assert fragment in error.message


def test_max_tokens_zero_is_not_silently_replaced(sampler: Any) -> None:
    future = sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 1, types.SamplingParams(max_tokens=0, stop=[]))
    try:
        response = future.result()
    except tinker.RequestFailedError as exc:
        assert exc.category == "user" and "max_tokens" in exc.message
    else:
        assert len(response.sequences[0].tokens) == 0, f"asked for 0 tokens, got {len(response.sequences[0].tokens)}"


def test_unknown_sampler_path_is_not_found(service_client: Any, training_client: Any) -> None:
    path = f"tinker://{training_client.model_id}/sampler_weights/never-saved"
    with pytest.raises(tinker.NotFoundError, match="never-saved"):
        service_client.create_sampling_client(model_path=path).result()


# ---- raw HTTP --------------------------------------------------------------------------------------------------
def test_retrieve_future_of_unknown_id_is_404(http: httpx.Client) -> None:
    body = error_json(http.post("/api/v1/retrieve_future", json={"request_id": "no-such-request"}), 404)
    assert "no-such-request" in body["message"]


def test_get_info_of_unknown_model_is_404(http: httpx.Client) -> None:
    body = error_json(http.post("/api/v1/get_info", json={"model_id": "nosession:train:0", "type": "get_info"}), 404)
    assert "nosession:train:0" in body["message"]


@pytest.mark.parametrize(("content", "encoding"), [
    (b"\xff\xff\xff", None),  # a truncated varint
    (b"\x0a\x10abc", None),  # a field running past the end of the message
    (b"not zstd at all", "zstd"),
])
def test_malformed_forward_backward_body_is_400(http: httpx.Client, content: bytes, encoding: str | None) -> None:
    headers = {"Content-Type": "application/x-protobuf", **({"Content-Encoding": encoding} if encoding else {})}
    body = error_json(http.post("/api/v1/forward_backward", content=content, headers=headers), 400)
    assert "cannot decode" in body["message"]


def test_invalid_json_body_is_400_naming_the_field(http: httpx.Client) -> None:
    body = error_json(http.post("/api/v1/create_model", json={"session_id": "x", "lora_config": {"rank": 4}}), 400)
    assert "base_model" in body["message"]


def test_asample_on_unknown_sampling_session_is_404(http: httpx.Client) -> None:
    r = http.post("/api/v1/asample", json={"sampling_session_id": "nosession:sample:0", "seq_id": 0, "num_samples": 1,
                                           "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
                                           "sampling_params": {"max_tokens": 2}, "type": "sample"})
    assert "nosession:sample:0" in error_json(r, 404)["message"]


def test_oversized_body_is_413_before_it_is_read(server_url: str) -> None:
    """The limit (256 MiB) is checked on Content-Length: announce a larger body, send none, get 413."""
    host, port = server_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /api/v1/forward_backward HTTP/1.1\r\nHost: test\r\nContent-Type: application/x-protobuf\r\n"
                     b"Content-Length: 300000000\r\n\r\n")
        head = sock.recv(65536).decode("latin-1")
    assert head.startswith("HTTP/1.1 413"), head
