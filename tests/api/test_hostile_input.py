"""Hostile or nonsensical input gets a 4xx naming the field (or a user error), never a 5xx, and never costs the
server more than its body limit; after each the server still answers (an autouse check). Through the SDK where
it can send the input, else raw HTTP (httpx, or a socket for chunked uploads)."""

from __future__ import annotations

import json
import math
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pydantic
import pytest
import tinker
import zstandard
from tinker import types

from sdk_training import token_datum as datum
from tinker.proto import request_conv

BASE_MODEL = "tiny-qwen3"
MAX_POSITIONS = 4096  # tiny-qwen3's max_position_embeddings
PROTOBUF = "application/x-protobuf"
ADAM = {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0, "grad_clip_norm": 0.0}
BODY_LIMIT = 256 * 1024 * 1024  # ServerSettings.max_request_bytes
MiB = 1024 * 1024


@pytest.fixture(scope="module")
def training_client(service_client: Any) -> Any:
    return service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=1).result()


@pytest.fixture(scope="module")
def sampler(service_client: Any) -> Any:
    return service_client.create_sampling_client(base_model=BASE_MODEL).result()



@pytest.fixture(autouse=True)
def server_stays_healthy(server_url: str) -> Iterator[None]:
    yield
    r = httpx.get(f"{server_url}/api/v1/healthz", timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "ok", r.text



def bad_request(future_or_call: Any) -> str:
    """The message of the 400 the SDK raises for a submit the server refused."""
    with pytest.raises(tinker.BadRequestError) as info:
        future_or_call() if callable(future_or_call) else future_or_call.result(timeout=120)
    return str(info.value)


def error_json(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    return response.json()["message"]


def fb_proto(model_id: str, seq_id: int, data: list[types.Datum], loss_fn: str = "cross_entropy",
             config: dict[str, float] | None = None, forward_only: bool = False) -> bytes:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config),
        model_id=model_id, seq_id=seq_id)
    message = request_conv.forward_backward_request_to_proto(request)
    message.forward_only = forward_only
    return message.SerializeToString()


GOOD = [datum([5, 17, 300, 42, 7])]
NAN, INF = float("nan"), float("inf")


# ---- non-finite numbers: 400 naming the field ------------------------------------------------------------------
@pytest.mark.parametrize(("inputs", "field"), [
    ({"weights": [1.0, NAN, 1.0, 1.0]}, "weights"),
    ({"weights": [1.0, 1.0, INF, 1.0]}, "weights"),
    ({"weights": [1.0, 1.0, 1e38, 1.0]}, "weights"),  # finite, but the loss can only overflow
])
def test_non_finite_weights_are_a_bad_request(training_client: Any, inputs: dict, field: str) -> None:
    message = bad_request(training_client.forward_backward([datum([5, 6, 7, 8, 9], **inputs)], "cross_entropy"))
    assert field in message and "datum 0" in message


def test_non_finite_advantages_are_a_bad_request(training_client: Any) -> None:
    data = [datum([5, 6, 7, 8], logprobs=[-1.0] * 3, advantages=[1.0, -INF, 1.0])]
    assert "advantages" in bad_request(training_client.forward_backward(data, "importance_sampling"))


def test_non_finite_loss_fn_config_is_a_bad_request(training_client: Any) -> None:
    data = [datum([5, 6, 7, 8], logprobs=[-1.0] * 3, advantages=[1.0] * 3)]
    message = bad_request(training_client.forward_backward(data, "ppo", {"clip_low_threshold": NAN}))
    assert "loss_fn_config" in message and "clip_low_threshold" in message


@pytest.mark.parametrize(("adam", "field"), [
    ({"learning_rate": NAN}, "learning_rate"),
    ({"grad_clip_norm": INF}, "grad_clip_norm"),
    ({"eps": 0.0}, "eps"),
    ({"eps": -1e-8}, "eps"),
    ({"learning_rate": -1e-3}, "learning_rate"),
    ({"beta1": 1.0}, "beta1"),
    ({"beta2": -0.1}, "beta2"),
])
def test_adam_params_that_can_only_give_nan_are_a_bad_request(training_client: Any, adam: dict, field: str) -> None:
    message = bad_request(training_client.optim_step(types.AdamParams(**{**ADAM, **adam})))
    assert f"adam_params.{field}" in message


@pytest.mark.parametrize("seed", [2**70, -1])
def test_sampling_seed_out_of_range_is_a_bad_request(sampler: Any, seed: int) -> None:
    prompt = types.ModelInput.from_ints([1, 2, 3])
    message = bad_request(sampler.sample(prompt, 1, types.SamplingParams(max_tokens=4, seed=seed)))
    assert "sampling_params.seed" in message and f"[0, {2**63 - 1}]" in message  # names the valid range


@pytest.mark.parametrize(("params", "field"), [({"temperature": NAN}, "temperature"), ({"top_p": INF}, "top_p"),
                                               ({"top_p": -INF}, "top_p")])
def test_non_finite_sampling_params_are_a_bad_request(sampler: Any, http: httpx.Client, params: dict,
                                                      field: str) -> None:
    """The SDK refuses to send NaN (its JSON encoder has allow_nan=False); other clients' JSON may carry it."""
    body = {"sampling_session_id": sampler._sampling_session_id, "seq_id": 0, "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
            "sampling_params": {"max_tokens": 4, **params}}
    r = http.post("/api/v1/asample", content=json.dumps(body).encode(),  # NaN / Infinity tokens, as Python writes
                  headers={"Content-Type": "application/json"})
    assert f"sampling_params.{field}" in error_json(r, 400)


@pytest.mark.parametrize(("change", "field"), [
    ({"num_samples": 2**70}, "num_samples"),
    ({"num_samples": 0}, "num_samples"),
    ({"topk_prompt_logprobs": 2**64}, "topk_prompt_logprobs"),
    ({"sampling_params": {"max_tokens": 2**64}}, "sampling_params.max_tokens"),
    ({"sampling_params": {"max_tokens": 4, "stop": [2**64]}}, "sampling_params.stop[0]"),
    ({"prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2**70]}]}}, "prompt token 1"),
])
def test_sampling_integers_beyond_int64_are_a_bad_request(sampler: Any, http: httpx.Client, change: dict,
                                                          field: str) -> None:
    body = {"sampling_session_id": sampler._sampling_session_id, "seq_id": 0, "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
            "sampling_params": {"max_tokens": 4}, **change}
    assert field in error_json(http.post("/api/v1/asample", json=body), 400)


def test_a_result_holding_nan_is_still_answered(service_client: Any, http: httpx.Client) -> None:
    """Finite inputs can still give non-finite results (here: an importance ratio exp(1e11) overflows). The SDK's
    protobuf carries them; a JSON client gets them as strings (strict JSON has no NaN; pydantic reads them back)."""
    model_id = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=5).result().model_id
    data = [datum([5, 6, 7, 8], logprobs=[-1e11] * 3, advantages=[1.0] * 3)]
    r = http.post("/api/v1/forward_backward", headers={"Content-Type": PROTOBUF},
                  content=fb_proto(model_id, 0, data, "importance_sampling", forward_only=True))
    assert r.status_code == 200, r.text
    request_id = r.json()["request_id"]
    answer = None
    for _ in range(10):  # long polls until done
        answer = http.post("/api/v1/retrieve_future", json={"request_id": request_id},
                           headers={"Accept": "application/json"})
        assert answer.status_code == 200, answer.text
        if orjson.loads(answer.content).get("type") != "try_again":
            break
    body = orjson.loads(answer.content)  # what the SDK's JSON path parses with: strict JSON
    assert "error" not in body, body
    # the SDK's response types are pydantic models with float fields (OptimStepResponse.metrics and the like)
    values = [*pydantic.TypeAdapter(dict[str, float]).validate_python(body["metrics"]).values(),
              *(v for out in body["loss_fn_outputs"] for t in out.values()
                for v in pydantic.TypeAdapter(list[float]).validate_python(t["data"]))]
    assert any(not math.isfinite(v) for v in values), values  # the case this test is about
    proto = http.post("/api/v1/retrieve_future", json={"request_id": request_id}, headers={"Accept": PROTOBUF})
    assert proto.status_code == 200 and proto.headers["content-type"] == PROTOBUF


# ---- out-of-range ids and shapes -------------------------------------------------------------------------------
def test_empty_datum_list_is_a_bad_request(training_client: Any, http: httpx.Client) -> None:
    r = http.post("/api/v1/forward_backward", content=fb_proto(training_client.model_id, 10_000, []),
                  headers={"Content-Type": PROTOBUF})
    assert "no datums" in error_json(r, 400)


def test_sequence_longer_than_the_model_is_a_bad_request(training_client: Any) -> None:
    tokens = [(7 * i) % 2000 + 5 for i in range(20_001)]
    message = bad_request(training_client.forward([datum(tokens)], "cross_entropy"))
    assert "20000 tokens" in message and str(MAX_POSITIONS) in message


@pytest.mark.parametrize("seq_id", [-5, -(2**31)])
def test_negative_seq_id_is_a_bad_request(training_client: Any, http: httpx.Client, seq_id: int) -> None:
    r = http.post("/api/v1/optim_step", json={"model_id": training_client.model_id, "seq_id": seq_id,
                                              "adam_params": ADAM})
    assert "seq_id" in error_json(r, 400)
    r = http.post("/api/v1/forward_backward", content=fb_proto(training_client.model_id, seq_id, GOOD),
                  headers={"Content-Type": PROTOBUF})
    assert "seq_id" in error_json(r, 400)


def test_seq_ids_outside_their_range_are_bad_requests(service_client: Any, training_client: Any,
                                                      http: httpx.Client) -> None:
    session_id = training_client.model_id.split(":")[0]
    r = http.post("/api/v1/create_model", json={"session_id": session_id, "model_seq_id": 2**80,
                                                "base_model": BASE_MODEL, "lora_config": {"rank": 4}})
    assert "model_seq_id" in error_json(r, 400)
    r = http.post("/api/v1/create_model", json={"session_id": session_id, "model_seq_id": 7,
                                                "base_model": BASE_MODEL, "lora_config": {"rank": 4, "seed": 2**64}})
    assert "lora_config.seed" in error_json(r, 400)
    r = http.post("/api/v1/optim_step", json={"model_id": training_client.model_id, "seq_id": 2**80,
                                              "adam_params": ADAM})
    assert "seq_id" in error_json(r, 400)
    r = http.post("/api/v1/create_sampling_session", json={"session_id": session_id, "sampling_session_seq_id": -1,
                                                           "base_model": BASE_MODEL})
    assert "sampling_session_seq_id" in error_json(r, 400)


@pytest.mark.parametrize("path", ["/api/v1/training_runs", "/api/v1/checkpoints"])
def test_page_offset_beyond_int64_is_a_bad_request(http: httpx.Client, path: str) -> None:
    assert "offset" in error_json(http.get(path, params={"offset": 2**80}), 400)


# ---- bodies: compressed, chunked ------------------------------------------------------------------------------
def _peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def _zstd_of_zeros(size: int) -> bytes:
    """A tiny zstd frame that inflates to `size` zero bytes, made without holding them."""
    compressor = zstandard.ZstdCompressor(level=1).compressobj()
    chunk = bytes(16 * MiB)
    out = [compressor.compress(chunk) for _ in range(size // len(chunk))]
    return b"".join([*out, compressor.flush()])


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the server's peak memory from /proc")
def test_decompression_bomb_stops_at_the_body_limit(server_url: Any, http: httpx.Client) -> None:
    """~30 KB of zstd that would inflate to 900 MiB (under the old 1 GiB decode cap): refused once the inflated
    bytes pass the body limit (256 MiB), so the server's peak memory grows by far less than the bomb's size."""
    bomb = _zstd_of_zeros(900 * MiB)
    assert len(bomb) < 100_000
    before = _peak_rss(server_url.process.pid)
    r = http.post("/api/v1/forward_backward", content=bomb,
                  headers={"Content-Type": PROTOBUF, "Content-Encoding": "zstd"})
    message = error_json(r, 400)
    assert "exceeds" in message and str(BODY_LIMIT) in message
    grown = _peak_rss(server_url.process.pid) - before
    assert grown < 600 * MiB, f"peak memory grew by {grown / MiB:.0f} MiB for a {len(bomb)}-byte body"


def test_chunked_upload_above_the_limit_is_cut_off(server_url: str) -> None:
    """No Content-Length (chunked): the limit holds on the bytes received; the server answers 413 without
    reading the rest."""
    host, port = server_url.removeprefix("http://").split(":")
    chunk = b"%x\r\n%s\r\n" % (MiB, bytes(MiB))
    sent = 0
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(b"POST /api/v1/forward_backward HTTP/1.1\r\nHost: test\r\nContent-Type: application/x-protobuf\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        try:
            while sent < BODY_LIMIT + 64 * MiB:
                sock.sendall(chunk)
                sent += MiB
            sock.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed: what this test wants
        head = sock.recv(65536).decode("latin-1")
    assert head.startswith("HTTP/1.1 413"), head[:200]
    assert "exceeds the limit" in head


# ---- checkpoint download URLs ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved_checkpoint(training_client: Any) -> str:
    return training_client.save_state("hostile-input").result(timeout=120).path


def test_download_urls_ignore_the_host_header(saved_checkpoint: str, server_url: str, http: httpx.Client) -> None:
    run_id, rest = saved_checkpoint.removeprefix("tinker://").split("/", 1)
    r = http.get(f"/api/v1/training_runs/{run_id}/checkpoints/{rest}/external_weights_urls",
                 headers={"Host": "evil.example"})
    assert r.status_code == 200, r.text
    urls = list(r.json()["urls"].values())
    assert urls and all(u.startswith(f"{server_url}/api/v1/checkpoint_files/") for u in urls), urls


def test_non_ascii_download_signature_is_a_bad_request(saved_checkpoint: str, http: httpx.Client) -> None:
    run_id, rest = saved_checkpoint.removeprefix("tinker://").split("/", 1)
    urls = http.get(f"/api/v1/training_runs/{run_id}/checkpoints/{rest}/external_weights_urls").json()["urls"]
    url = next(iter(urls.values()))
    forged = url.split("&sig=")[0] + "&sig=%C3%A9%C3%A9"
    assert "signature" in error_json(http.get(forged), 400)
    assert http.get(url).status_code == 200  # the real one still works


def test_the_client_still_trains_after_all_that(training_client: Any) -> None:
    fwd = training_client.forward(GOOD, "cross_entropy").result(timeout=120)
    assert math.isfinite(fwd.metrics["loss:sum"])
    metrics = training_client.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=120).metrics
    assert math.isfinite(metrics["grad_norm"])


def test_non_finite_metadata_is_a_bad_request(http: httpx.Client) -> None:
    body = {"tags": [], "user_metadata": {"score": [1.0, float("nan")]}}
    r = http.post("/api/v1/create_session", content=json.dumps(body).encode(),
                  headers={"Content-Type": "application/json"})
    assert "user_metadata['score'][1]" in error_json(r, 400)


def test_public_url_setting() -> None:
    from skyrl_tx.config import ServerSettings
    from skyrl_tx.errors import InvalidArgumentError

    assert ServerSettings("m", host="10.0.0.5", port=9000).public_base_url() == "http://10.0.0.5:9000"
    assert ServerSettings("m", host="0.0.0.0", port=9000).public_base_url() == "http://127.0.0.1:9000"
    settings = ServerSettings("m", public_url="https://tinker.example.com/")
    settings.validate()
    assert settings.public_base_url() == "https://tinker.example.com"
    for bad in ("tinker.example.com", "ftp://x", "https://x/?a=1"):
        with pytest.raises(InvalidArgumentError, match="--public-url"):
            ServerSettings("m", public_url=bad).validate()
