"""Server-side custom losses through the tinker SDK (create_custom_loss + forward_backward_custom with its handle):
one server pass gives the loss, metrics and weight update of the same math run client-side (the SDK's two-pass
path: forward, then cross-entropy with weights = -dL/dlogprobs); hostile graphs are refused naming the node."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import tinker
import torch
from prometheus_client.parser import text_string_to_metric_families
from raw_futures import retrieve
from tinker import types

BASE_MODEL = "tiny-qwen3"
ADAM = types.AdamParams(learning_rate=5e-2)


def clipped_ratio_with_kl(logprobs, sampling_logprobs, advantages):
    """A clipped importance-ratio loss with a KL term, as the Tinker docs write custom losses."""
    ratio = torch.exp(logprobs - sampling_logprobs)
    clipped = torch.clamp(ratio, 0.8, 1.2)
    pg = -torch.minimum(ratio * advantages, clipped * advantages).sum()
    kl = (ratio - 1 - (logprobs - sampling_logprobs)).mean()
    return pg + 0.1 * kl, {"custom/kl:mean": kl, "custom/pg:sum": pg}


RANKS = {"logprobs": 1, "sampling_logprobs": 1, "advantages": 1}


def data() -> list[types.Datum]:
    g = torch.Generator().manual_seed(3)
    out = []
    for n in (6, 9, 4):
        tokens = torch.randint(10, 2000, (n + 1,), generator=g)
        out.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1].tolist()), loss_fn_inputs={
            "target_tokens": types.TensorData.from_torch(tokens[1:]),
            "sampling_logprobs": types.TensorData.from_torch(-torch.rand(n, generator=g) * 6 - 2),
            "advantages": types.TensorData.from_torch(torch.randn(n, generator=g))}))
    return out


def client_side(data_list: list[types.Datum], logprobs_list: list[torch.Tensor]):
    """The same math as a plain callable: the SDK runs it on the client (forward, then a surrogate backward)."""
    total, kl, pg = 0.0, 0.0, 0.0
    for datum, logprobs in zip(data_list, logprobs_list):
        loss, metrics = clipped_ratio_with_kl(logprobs, datum.loss_fn_inputs["sampling_logprobs"].to_torch(),
                                              datum.loss_fn_inputs["advantages"].to_torch())
        total, kl, pg = total + loss, kl + metrics["custom/kl:mean"].item(), pg + metrics["custom/pg:sum"].item()
    return total, {"custom/kl:mean": kl / len(data_list), "custom/pg:sum": pg}


@pytest.fixture(scope="module")
def loss_handle(service_client: Any) -> Any:
    """The session's handle (the SDK lets a session create each traced loss once)."""
    handle = service_client.create_custom_loss(clipped_ratio_with_kl, RANKS).result()
    assert handle.loss_id is not None  # the server runs it (client config custom_loss_server_side)
    return handle


def forward_count(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "skyrl_tx_requests_total" and s.labels.get("type") == "forward")


def after_step_logprobs(client: Any) -> list[float]:
    probe = types.Datum(model_input=types.ModelInput.from_ints([5, 17, 300, 42, 7]),
                        loss_fn_inputs={"target_tokens": [17, 300, 42, 7, 99], "weights": [1.0] * 5})
    return client.forward([probe], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()


def test_server_side_loss_equals_the_client_side_run_in_one_pass(service_client: Any, server_url: str,
                                                                 loss_handle: Any) -> None:
    handle = loss_handle
    server = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=11).result()
    client = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=11).result()

    forwards = forward_count(server_url)
    ours = server.forward_backward_custom(data(), handle).result()
    assert forward_count(server_url) == forwards  # one forward_backward, no separate forward pass
    theirs = client.forward_backward_custom(data(), client_side).result()
    assert forward_count(server_url) > forwards  # the client-side path's first pass
    for key in ("loss:sum", "custom/kl:mean", "custom/pg:sum", "surrogate_loss:sum"):
        assert ours.metrics[key] == pytest.approx(theirs.metrics[key], rel=1e-4, abs=1e-5), key
    for a, b in zip(ours.loss_fn_outputs, theirs.loss_fn_outputs):
        assert a["logprobs"].tolist() == pytest.approx(b["logprobs"].tolist(), abs=1e-5)

    server.optim_step(ADAM).result()
    client.optim_step(ADAM).result()
    stepped = after_step_logprobs(server)
    assert stepped == pytest.approx(after_step_logprobs(client), abs=1e-4)
    fresh = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=11).result()
    assert max(abs(a - b) for a, b in zip(stepped, after_step_logprobs(fresh))) > 1e-3  # the step did something


def hostile(http: Any, session_id: str, seq: int, node: dict, inputs=None) -> httpx.Response:
    nodes = [{"op": "placeholder", "name": "logprobs", "target": "logprobs", "args": [], "kwargs": {}}, node,
             {"op": "output", "name": "output", "target": "output",
              "args": [{"tuple": [{"ref": node["name"]}, {"dict": {}}]}], "kwargs": {}}]
    body = {"session_id": session_id, "custom_loss_seq_id": seq, "name": "hostile",
            "inputs": inputs or [{"name": "logprobs", "rank": 1}], "graph": {"format": 1, "nodes": nodes}}
    return http.post("/api/v1/create_custom_loss", json=body)


@pytest.mark.parametrize("node, named", [
    ({"op": "call_function", "name": "evil", "target": "builtins.eval", "args": ["1"], "kwargs": {}}, "evil"),
    ({"op": "call_function", "name": "shell", "target": "os.system", "args": ["true"], "kwargs": {}}, "shell"),
    ({"op": "call_function", "name": "peek", "target": "getattr", "args": [{"ref": "logprobs"}, "__dict__"],
      "kwargs": {}}, "peek"),
])
def test_operations_off_the_allow_list_fail_as_user_errors(service_client: Any, http: Any, node: dict,
                                                           named: str) -> None:
    session_id = service_client.holder.get_session_id()
    created = hostile(http, session_id, 1000 + hash(named) % 1000, node)
    assert created.status_code == 200, created.text
    answer = retrieve(http, created.json()["request_id"])
    assert answer["category"] == "user" and f"node '{named}'" in answer["error"], answer
    # A loss that was refused cannot be used: forward_backward names the loss_id.
    model = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=1).result()
    with pytest.raises(tinker.BadRequestError, match="loss_id"):
        model.forward_backward(data(), "custom", {"loss_id": created.json()["request_id"]}).result()


@pytest.mark.parametrize("node, inputs, message", [
    ({"op": "call_module", "name": "mod", "target": "lin", "args": [], "kwargs": {}}, None, "call_module"),
    ({"op": "call_function", "name": "e", "target": "torch.exp", "args": [{"ref": "logprobs"}], "kwargs": {}},
     [{"name": "logprobs", "rank": 1}] + [{"name": f"x{i}", "rank": 1} for i in range(16)], "at most 15"),
    ({"op": "call_function", "name": "e", "target": "torch.exp", "args": [{"ref": "logprobs"}], "kwargs": {}},
     [{"name": "logprobs", "rank": 1}, {"name": "cube", "rank": 3}], "rank 0, 1 or 2"),
])
def test_malformed_graphs_are_bad_requests(service_client: Any, http: Any, node: dict, inputs: Any,
                                           message: str) -> None:
    r = hostile(http, service_client.holder.get_session_id(), 5, node, inputs)
    assert r.status_code == 400 and message in r.json()["message"], r.text


def test_another_sessions_loss_is_refused(loss_handle: Any, tinker_env: str) -> None:
    handle = loss_handle
    with tinker.ServiceClient() as other:  # another session of the same key
        model = other.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=1).result()
        with pytest.raises(tinker.BadRequestError, match="not a custom loss of this session"):
            model.forward_backward(data(), "custom", {"loss_id": handle.loss_id}).result()
