"""The SDK's REST surface on a server with API keys: every path the installed SDK calls is in /openapi.json; through
the SDK's RestClient / AdminClient: sessions list and get, project assignment and the training-run filter, the audit
log after create / save / delete, usage after a training step and a sample, the key's whoami, the trace export
(another key's session: 404); another key sees none of it."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
from prometheus_client.parser import text_string_to_metric_families
from keyed_server import keyed_server, service_clients, status_of
from skyrl_tx.keys import list_keys
from live_server import ServerUrl
from tinker import types

KEYS = {"alice": {}, "bob": {}, "root": {"admin": True}, "dave": {}}
TOKENS = list(range(5, 21))  # a 15-token datum
METHODS = {"get", "post", "put", "delete", "patch"}


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def server_url(request: pytest.FixtureRequest, preset_cache) -> Iterator[ServerUrl]:
    with keyed_server(request.param, KEYS, backend_config={"max_lora_adapters": 2}) as url:
        yield url


def _template(node: ast.expr) -> str | None:
    """A path literal: a string, or an f-string with each {expression} kept as {}."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    return None


def _method(call: ast.Call) -> str | None:
    """client.get(path) / self._post(path) → GET / POST; self._request("DELETE", path) → DELETE."""
    name = call.func.attr.strip("_") if isinstance(call.func, ast.Attribute) else ""
    if name in METHODS:
        return name.upper()
    first = call.args[0] if call.args else None
    if isinstance(first, ast.Constant) and isinstance(first.value, str) and first.value.lower() in METHODS:
        return first.value.upper()
    return None


def sdk_calls() -> set[tuple[str, str]]:
    """(method, path template) of every /api/v1 call in the installed SDK's source (its own tests left out)."""
    calls, unresolved = set(), []
    for file in Path(tinker.__file__).parent.rglob("*.py"):
        if file.name.endswith("_test.py"):
            continue
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if not isinstance(node, ast.Call):
                continue
            path = next((p for p in map(_template, node.args) if p and p.startswith("/api/v1/")), None)
            if path is None:
                continue
            method = _method(node)
            if method is None:
                unresolved.append(f"{file.name}:{node.lineno} {path}")
            calls.add((method or "?", re.sub(r"\{[^}]*\}", "{}", path)))
    assert not unresolved, f"calls whose HTTP method this test cannot read: {unresolved}"
    return calls


def served(spec: dict[str, Any], method: str, template: str) -> bool:
    """An SDK {} may stand for several server segments (a checkpoint id is <kind>/<name>)."""
    pattern = "".join(r"\{[^/}]+\}(?:/\{[^/}]+\})*" if part == "{}" else re.escape(part)
                      for part in re.split(r"(\{\})", template))
    return any(re.fullmatch(pattern, path) and method.lower() in item for path, item in spec["paths"].items())


def test_every_path_the_installed_sdk_calls_is_served(server_url: ServerUrl) -> None:
    calls = sdk_calls()
    assert len(calls) >= 40 and ("GET", "/api/v1/sessions/{}") in calls and ("PUT", "/api/v1/sessions/{}/project") \
        in calls and ("DELETE", "/api/v1/auth/apikey/me") in calls, sorted(calls)  # the parser found the calls
    spec = httpx.get(f"{server_url}/openapi.json", timeout=60).json()
    missing = sorted(f"{m} {p}" for m, p in calls if not served(spec, m, p))
    assert not missing, f"the SDK calls paths this server does not serve: {missing}"
    assert not served(spec, "GET", "/api/v1/sessions/{}/no_such_thing")  # the matcher can say no


@pytest.fixture(scope="module")
def clients(server_url: ServerUrl) -> Iterator[dict[str, tinker.ServiceClient]]:
    with service_clients(server_url) as by_key:
        yield by_key


def datum() -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]),
                       loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)})


@pytest.fixture(scope="module")
def alice(clients: dict[str, tinker.ServiceClient]) -> dict[str, Any]:
    """Alice's session: a model trained one step, a saved then deleted checkpoint, a sampler checkpoint and a sample
    from it (2 prompt tokens, 3 sampled)."""
    started = datetime.now(timezone.utc)
    training = clients["alice"].create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=1).result()
    training.forward_backward([datum()], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    doomed = training.save_state("doomed").result().path
    sampler_path = training.save_weights_for_sampler("s1").result().path
    sampler = clients["alice"].create_sampling_client(model_path=sampler_path).result()
    sample = sampler.sample(types.ModelInput.from_ints([5, 6]), 1,
                            types.SamplingParams(max_tokens=3, seed=0, stop=[])).result()
    return {"training": training, "doomed": doomed, "sampler_path": sampler_path, "started": started,
            "sampled": len(sample.sequences[0].tokens), "session_id": training.model_id.split(":")[0]}


def rest(server_url: ServerUrl, name: str) -> tinker.RestClient:
    return tinker.RestClient(base_url=server_url, api_key=server_url.keys[name])


def admin(server_url: ServerUrl, name: str) -> tinker.AdminClient:
    return tinker.AdminClient(base_url=server_url, api_key=server_url.keys[name])


def raw(server_url: ServerUrl, name: str) -> httpx.Client:
    return httpx.Client(base_url=server_url, headers={"X-API-Key": server_url.keys[name]}, timeout=60)


def test_sessions_list_and_get_with_models_samplers_and_heartbeat(server_url: ServerUrl, alice) -> None:
    client = rest(server_url, "alice")
    assert alice["session_id"] in client.list_sessions().result().sessions
    got = client.get_session(alice["session_id"]).result()
    assert got.training_run_ids == [alice["training"].model_id] and len(got.sampler_ids) == 1
    with raw(server_url, "alice") as http:
        body = http.get(f"/api/v1/sessions/{alice['session_id']}").json()
        assert body["status"] == "active" and body["last_heartbeat_at"] and body["owner"].startswith("key-")
        page = http.get("/api/v1/sessions", params={"limit": 1}).json()
        assert len(page["sessions"]) == 1 and page["cursor"]["total_count"] >= 1
        assert http.get("/api/v1/sessions", params={"limit": 0}).status_code == 400
        assert http.get("/api/v1/sessions", params={"access_scope": "everyone"}).status_code == 400


def test_another_key_sees_none_of_alices_sessions_an_admin_all(server_url: ServerUrl, alice) -> None:
    assert alice["session_id"] not in rest(server_url, "bob").list_sessions(access_scope="accessible").result().sessions
    assert status_of(lambda: rest(server_url, "bob").get_session(alice["session_id"]).result()) == 404
    root = rest(server_url, "root")
    assert alice["session_id"] not in root.list_sessions().result().sessions  # "owned": the admin's own
    assert alice["session_id"] in root.list_sessions(limit=100, access_scope="accessible").result().sessions


def test_a_session_moves_into_a_project_and_runs_filter_by_it(server_url: ServerUrl, alice) -> None:
    client, model_id = rest(server_url, "alice"), alice["training"].model_id
    client.assign_session_project(alice["session_id"], "proj-x").result()
    assert [r.training_run_id for r in client.list_training_runs(project_id="proj-x").result().training_runs] == \
        [model_id]
    assert client.list_training_runs(project_id="proj-y").result().training_runs == []
    with raw(server_url, "alice") as http:
        assert http.get(f"/api/v1/sessions/{alice['session_id']}").json()["project_id"] == "proj-x"
        refused = http.put(f"/api/v1/sessions/{alice['session_id']}/project", json={"project_id": " "})
        assert refused.status_code == 400 and "project_id" in refused.json()["message"]
    assert status_of(lambda: rest(server_url, "bob").assign_session_project(alice["session_id"], "p").result()) == 404


def test_the_audit_log_records_create_save_and_delete(server_url: ServerUrl, alice) -> None:
    client = rest(server_url, "alice")
    client.delete_checkpoint_from_tinker_path(alice["doomed"]).result()
    entries = admin(server_url, "alice").get_audit_log().result().entries
    events = [(e.event, e.event_details.get("resource")) for e in entries]
    model_id = alice["training"].model_id
    for expected in (("model_create", model_id), ("checkpoint_save", alice["doomed"]),
                     ("checkpoint_save", alice["sampler_path"]), ("checkpoint_delete", alice["doomed"])):
        assert expected in events, events
    delete = next(e for e in entries if e.event == "checkpoint_delete")
    assert delete.tinker_path == alice["doomed"] and delete.event_details["request_id"]
    assert delete.event_details["actor"] == delete.event_details["owner"] != "local"
    assert [e.timestamp for e in entries] == sorted(e.timestamp for e in entries)
    checkpoints = admin(server_url, "alice").get_audit_log("checkpoints").result().entries
    assert {e.event for e in checkpoints} <= {"checkpoint_save", "checkpoint_delete"}
    assert not any(e.event_details.get("owner") == delete.event_details["owner"]
                   for e in admin(server_url, "bob").get_audit_log().result().entries)
    assert any(e.event == "checkpoint_delete" for e in admin(server_url, "root").get_audit_log().result().entries)
    with raw(server_url, "alice") as http:
        first = http.get("/api/v1/audit", params={"limit": 1}).json()
        assert len(first["entries"]) == 1 and first["next_after_id"] is not None
        rest_ = http.get("/api/v1/audit", params={"after_id": first["next_after_id"]}).json()["entries"]
        assert len(rest_) == len(entries) - 1


def test_usage_counts_the_tokens_trained_prefilled_sampled_and_checkpoints(server_url: ServerUrl, alice) -> None:
    start = alice["started"].replace(minute=0, second=0, microsecond=0)
    end = datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)
    usage = admin(server_url, "alice").get_billing_usage(start, end).result()
    totals: dict[str, int] = {}
    for event in usage.data:
        info = event.event_info
        totals[info.type] = totals.get(info.type, 0) + getattr(info, "token_count", getattr(info, "count", 0))
        assert event.session_id == alice["session_id"] and event.user_name == "alice"
    assert totals == {"training": len(TOKENS) - 1, "sampling_prefill": 2, "sampling_sample": alice["sampled"],
                      "checkpoint": 2}
    assert admin(server_url, "bob").get_billing_usage(start, end).result().data == []
    storage = admin(server_url, "alice").get_current_checkpoint_storage_usage().result().data
    assert len(storage) == 1 and storage[0].checkpoint_count >= 1 and storage[0].size_bytes > 0
    assert admin(server_url, "bob").get_current_checkpoint_storage_usage().result().data == []
    with raw(server_url, "alice") as http:
        refused = http.get("/api/v1/billing/usage/events", params={"starting_on": "2026-01-01T00:30:00Z",
                                                                   "ending_before": "2026-01-02T00:00:00Z"})
        assert refused.status_code == 400 and "starting_on" in refused.json()["message"]


def test_whoami_names_the_key_for_the_sdk_login(server_url: ServerUrl) -> None:
    from tinker.cli.auth_api import TinkerAuthApi

    with httpx.Client(timeout=60) as http:
        me = TinkerAuthApi(http, base_url=server_url).get_self_api_key(server_url.keys["alice"])
        assert me.name == "alice" and me.key_id > 0 and me.details.org_details.name == "skyrl_tx"
        body = http.get(f"{server_url}/api/v1/auth/apikey/me", headers={"X-API-Key": server_url.keys["root"]}).json()
        assert body["admin"] is True and body["user_urn"] == f"skyrl_tx:key:{body['id']}"
        token = http.post(f"{server_url}/api/v1/auth/token", json={}, headers={"X-API-Key": server_url.keys["bob"]})
        assert token.status_code == 400 and "X-API-Key" in token.json()["message"]


def test_logout_revokes_the_presented_key_only(server_url: ServerUrl) -> None:
    from tinker.cli.auth_api import TinkerAuthApi

    with httpx.Client(timeout=60) as http:
        auth = TinkerAuthApi(http, base_url=server_url)
        auth.delete_self_api_key(server_url.keys["dave"])
        assert auth.get_self_api_key(server_url.keys["bob"]).name == "bob"
    revoked = {k.name for k in list_keys(server_url.database_url) if k.revoked_at is not None}
    assert revoked == {"dave"}  # the server stops taking it within a second (its key cache's life)
    entries = [e for e in admin(server_url, "root").get_audit_log("organizations").result().entries
               if e.event == "key_revoke"]
    assert len(entries) == 1 and entries[0].event_details["name"] == "dave"
    assert entries[0].event_details["actor"] == entries[0].event_details["owner"]  # the key revoked itself


def test_trace_export_of_another_keys_session_is_not_found(server_url: ServerUrl, alice) -> None:
    # The export itself (pending -> ready, the file's spans) is tests/api/test_trace_export.py's.
    assert status_of(lambda: rest(server_url, "bob").export_session_trace(alice["session_id"]).result()) == 404


def test_metrics_are_for_admin_keys_and_count_per_key_id(server_url: ServerUrl, alice) -> None:
    with raw(server_url, "alice") as http:
        refused = http.get("/metrics")
        assert refused.status_code == 403 and "admin" in refused.json()["message"]
        alice_id = http.get("/api/v1/auth/apikey/me").json()["id"]
    with raw(server_url, "root") as http:
        text = http.get("/metrics").text
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]

    def total(name: str, **labels: str) -> float:
        return sum(s.value for s in samples if s.name == name and labels.items() <= s.labels.items())

    assert total("skyrl_tx_key_tokens_total", key_id=alice_id, kind="trained") == len(TOKENS) - 1
    assert total("skyrl_tx_key_tokens_total", key_id=alice_id, kind="prefilled") == 2
    assert total("skyrl_tx_key_tokens_total", key_id=alice_id, kind="sampled") == alice["sampled"]
    assert total("skyrl_tx_key_requests_total", key_id=alice_id, type="forward_backward", outcome="ok") == 1
    assert total("skyrl_tx_key_requests_total", key_id=alice_id, type="sample", outcome="ok") == 1
    assert not any(server_url.keys[name] in text for name in KEYS)  # no secret anywhere
