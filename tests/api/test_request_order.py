"""Per-model order by seq_id through a live server: a late request is waited for (never skipped), and a closed
session's adapter slots are free for the next user at once."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
import tinker
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from sdk_training import datum



@pytest.fixture(scope="module")
def server_options() -> dict[str, Any]:
    # one slot: a leaked adapter blocks the next user; a 2 s long poll: the test below waits out one
    return {"backend_config": {"max_lora_adapters": 1}, "extra_args": ["--long-poll-s", "2"]}


def _retrieve(base_url: str, request_id: str, timeout_s: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        answer = httpx.post(f"{base_url}/api/v1/retrieve_future", json={"request_id": request_id}, timeout=60).json()
        if answer.get("type") != "try_again":
            return answer
    raise TimeoutError(f"request {request_id} did not finish in {timeout_s} s")


def test_forward_backward_arriving_after_its_optim_step_is_applied_first(tinker_env: str) -> None:
    """The client's optim_step (seq 2) reaches the server a long poll before the forward_backward (seq 1) it
    follows: the step must still see that forward_backward's gradients (a non-zero grad_norm), never run before it."""
    with tinker.ServiceClient() as service:
        model_id = service.create_lora_training_client(base_model="tiny-qwen3", rank=4).result().model_id
        step = httpx.post(f"{tinker_env}/api/v1/optim_step", timeout=30, json={
            "model_id": model_id, "seq_id": 2, "adam_params": {"learning_rate": 1e-3}}).json()
        # A slow upload: the step waits (one long poll, 2 s here, answers try_again saying for what), never runs first.
        waiting = httpx.post(f"{tinker_env}/api/v1/retrieve_future", json={"request_id": step["request_id"]},
                             timeout=60).json()
        assert waiting["type"] == "try_again", waiting
        assert "waiting for request seq_id 1 of model" in waiting["queue_state_reason"], waiting
        assert waiting["queue_state"] == "paused_capacity", waiting  # the SDK logs the reason only when paused
        fb = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(
            data=[datum(0)], loss_fn="cross_entropy"), model_id=model_id, seq_id=1)
        body = forward_backward_request_to_proto(fb).SerializeToString()
        late = httpx.post(f"{tinker_env}/api/v1/forward_backward", content=body, timeout=30,
                          headers={"Content-Type": "application/x-protobuf"}).json()
        fb_result, step_result = _retrieve(tinker_env, late["request_id"]), _retrieve(tinker_env, step["request_id"])
        assert "loss_fn_outputs" in fb_result, fb_result
        assert step_result["metrics"]["grad_norm"] > 0, step_result  # the step saw the late gradients


def test_after_close_the_next_user_gets_the_freed_slot(tinker_env: str) -> None:
    """ServiceClient.close() finishes the session: its models are unloaded at once (one adapter slot here), so a
    second user's create_model succeeds without waiting for the session timeout."""
    adam = types.AdamParams(learning_rate=1e-3)
    for _user in range(2):
        with tinker.ServiceClient() as service:
            client = service.create_lora_training_client(base_model="tiny-qwen3", rank=4).result()
            client.forward_backward([datum(0)], "cross_entropy").result()
            client.optim_step(adam).result()


def test_a_finished_session_answers_heartbeats_with_410(tinker_env: str) -> None:
    """The SDK stops its heartbeat loop on a 410; a finished session must not look alive (or be revived)."""
    with tinker.ServiceClient() as service:
        client = service.create_lora_training_client(base_model="tiny-qwen3", rank=4).result()
        session_id = client.model_id.split(":train:")[0]  # model ids are <session>:train:<n>
        assert httpx.post(f"{tinker_env}/api/v1/session_heartbeat", json={"session_id": session_id}).status_code == 200
    answer = httpx.post(f"{tinker_env}/api/v1/session_heartbeat", json={"session_id": session_id})
    assert answer.status_code == 410 and "ended" in answer.text, answer.text
