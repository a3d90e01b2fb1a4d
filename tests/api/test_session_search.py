"""sessions/search through the SDK's RestClient.search_sessions on a server with API keys: a key finds its own
sessions only (an admin every one), newest first; filters by status (active / the finish reason its client gave),
display-name words, session id, user_metadata and project; keyset pages; checkpoint totals; bad filters get a 400
naming the field."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import tinker
from keyed_server import keyed_server
from live_server import ServerUrl
from tinker import types

KEYS = {"alice": {}, "bob": {}, "carol": {}, "root": {"admin": True}}


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def server_url(request: pytest.FixtureRequest, preset_cache) -> Iterator[ServerUrl]:
    with keyed_server(request.param, KEYS, backend_config={"max_lora_adapters": 2}) as url:
        yield url


@pytest.fixture(scope="module")
def sessions(server_url: ServerUrl) -> Iterator[dict[str, str]]:
    """Alice's sessions a1 (finished "success", one sampler checkpoint), a2 (active), a3 (finished "errored"); Bob's
    b1 (active). Created in that order, so newest first is a3, a2, a1."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINKER_TELEMETRY", "0")
        alice, bob = server_url.keys["alice"], server_url.keys["bob"]
        a1 = tinker.ServiceClient({"team": "rl", "exp": "1"}, "proj-a", display_name="Nightly Run Alpha",
                                  base_url=server_url, api_key=alice)
        training = a1.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=1).result()
        training.save_weights_for_sampler("s1").result()
        ids = {"a1": a1.holder.get_session_id()}
        a1.close("success").result()
        a2 = tinker.ServiceClient({"team": "sft"}, display_name="daily beta", base_url=server_url, api_key=alice)
        ids["a2"] = a2.holder.get_session_id()
        a3 = tinker.ServiceClient(base_url=server_url, api_key=alice)
        ids["a3"] = a3.holder.get_session_id()
        a3.close("errored", "boom").result()
        b1 = tinker.ServiceClient(display_name="nightly bob", base_url=server_url, api_key=bob)
        ids["b1"] = b1.holder.get_session_id()
        yield ids
        a2.close("success").result()
        b1.close("success").result()


def search(server_url: ServerUrl, key: str, **fields: Any) -> types.SessionSearchResponse:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # search_sessions is experimental in the SDK
        rest = tinker.RestClient(base_url=server_url, api_key=server_url.keys[key])
        return rest.search_sessions(types.SessionSearchRequest(**fields)).result()


def ids(server_url: ServerUrl, key: str, **fields: Any) -> list[str]:
    return [s.session_id for s in search(server_url, key, **fields).sessions]


def test_own_sessions_newest_first_with_their_summary(server_url: ServerUrl, sessions: dict[str, str]) -> None:
    page = search(server_url, "alice")
    assert [s.session_id for s in page.sessions] == [sessions["a3"], sessions["a2"], sessions["a1"]]
    assert page.next_cursor is None
    a3, a2, a1 = page.sessions
    assert a1.display_name == "Nightly Run Alpha" and a1.project_id == "proj-a"
    assert a1.user_metadata == {"team": "rl", "exp": "1"}
    assert a1.checkpoints_count == 1 and a1.checkpoint_storage_bytes > 0
    assert isinstance(a1.status, types.ClientSessionFinished) and a1.status.reason.type == "success"
    assert isinstance(a2.status, types.SessionActive) and a2.project_id == "default" and a2.checkpoints_count == 0
    assert isinstance(a3.status, types.ClientSessionFinished) and a3.status.reason.type == "errored"
    assert a3.status.detail == "boom" and a3.display_name is None
    assert a1.owner == a2.owner == a3.owner != search(server_url, "bob").sessions[0].owner
    assert a1.created_at < a2.created_at < a3.created_at


def test_a_key_sees_only_its_own_and_an_admin_every_one(server_url: ServerUrl, sessions: dict[str, str]) -> None:
    alice_owner = search(server_url, "alice").sessions[0].owner
    assert ids(server_url, "bob") == [sessions["b1"]]
    assert ids(server_url, "bob", owner=types.AccessibleSearchOwner()) == [sessions["b1"]]
    assert ids(server_url, "bob", owner=types.UserSearchOwner(owner_urns=[alice_owner])) == []
    bob_owner = search(server_url, "bob").sessions[0].owner
    both = types.UserSearchOwner(owner_urns=[alice_owner, bob_owner])
    assert ids(server_url, "root", owner=both) == [sessions[k] for k in ("b1", "a3", "a2", "a1")]
    assert ids(server_url, "root", owner=types.UserSearchOwner(owner_urns=[alice_owner])) == \
        [sessions[k] for k in ("a3", "a2", "a1")]
    everyone = types.AccessibleSearchOwner()
    assert ids(server_url, "root", owner=everyone, project_ids=["proj-a"]) == [sessions["a1"]]
    assert ids(server_url, "root", owner=everyone, session_id=sessions["b1"]) == [sessions["b1"]]
    assert ids(server_url, "alice", owner=everyone, session_id=sessions["b1"]) == []
    assert ids(server_url, "root") == []  # the admin's own: none


def test_status_filters(server_url: ServerUrl, sessions: dict[str, str]) -> None:
    assert ids(server_url, "alice", statuses=[types.ActiveSessionStatusQuery()]) == [sessions["a2"]]
    finished = types.ClientFinishedSessionStatusQuery
    assert ids(server_url, "alice", statuses=[finished()]) == [sessions["a3"], sessions["a1"]]
    assert ids(server_url, "alice", statuses=[finished(reasons=["errored", "interrupted"])]) == [sessions["a3"]]
    assert ids(server_url, "alice", statuses=[types.ActiveSessionStatusQuery(), finished(reasons=["success"])]) \
        == [sessions["a2"], sessions["a1"]]
    assert ids(server_url, "alice", statuses=[types.FailedSessionStatusQuery(),
                                              types.CancelledSessionStatusQuery()]) == []


def test_name_id_metadata_and_project_filters(server_url: ServerUrl, sessions: dict[str, str]) -> None:
    assert ids(server_url, "alice", display_name="alpha NIGHTLY") == [sessions["a1"]]
    assert ids(server_url, "alice", display_name="nightly beta") == []  # every word must appear
    assert ids(server_url, "alice", display_name="nightly", session_id=sessions["a3"]) == [sessions["a3"],
                                                                                            sessions["a1"]]
    assert ids(server_url, "alice", session_id=sessions["a2"]) == [sessions["a2"]]
    assert ids(server_url, "alice", session_id=sessions["b1"]) == []  # Bob's: not found for Alice
    assert ids(server_url, "alice", user_metadata={"team": "rl"}) == [sessions["a1"]]
    assert ids(server_url, "alice", user_metadata={"team": "rl", "exp": "2"}) == []
    assert ids(server_url, "alice", project_ids=["proj-a"]) == [sessions["a1"]]
    assert ids(server_url, "alice", project_ids=["default"]) == [sessions["a3"], sessions["a2"]]


def test_pages_follow_the_cursor(server_url: ServerUrl, sessions: dict[str, str]) -> None:
    seen, cursor = [], None
    for _ in range(4):
        page = search(server_url, "alice", limit=1, cursor=cursor)
        seen += [s.session_id for s in page.sessions]
        cursor = page.next_cursor
        if cursor is None:
            break
    assert seen == [sessions["a3"], sessions["a2"], sessions["a1"]] and cursor is None
    two = search(server_url, "alice", limit=2, display_name="a")  # a name filter applied after the database's
    assert [s.session_id for s in two.sessions] == [sessions["a2"], sessions["a1"]] and two.next_cursor is None


def test_first_finish_reason_stays(server_url: ServerUrl, sessions: dict[str, str]) -> None:
    response = httpx.post(f"{server_url}/api/v1/sessions/{sessions['a3']}/finish",
                          headers={"X-API-Key": server_url.keys["alice"]},
                          json={"reason": {"type": "interrupted"}, "detail": "later"})
    assert response.status_code == 204, response.text
    (a3,) = search(server_url, "alice", session_id=sessions["a3"]).sessions
    assert (a3.status.reason.type, a3.status.detail) == ("errored", "boom")


def test_filters_applied_after_the_database_scan_past_its_batches(server_url: ServerUrl) -> None:
    """Carol's 230 sessions: a name filter reads them in batches of 200 (newest first) to find the oldest."""
    headers = {"X-API-Key": server_url.keys["carol"]}
    made = [httpx.post(f"{server_url}/api/v1/create_session", headers=headers,
                       json={"tags": [], "sdk_version": "0", "user_metadata": {}, "display_name": f"bulk {i:03d}"}
                       ).json()["session_id"] for i in range(230)]
    assert ids(server_url, "carol", display_name="bulk 000") == [made[0]]
    assert ids(server_url, "carol", display_name="bulk", limit=200) == made[::-1][:200]
    page = search(server_url, "carol", display_name="BULK 00")  # each word: bulk 200, bulk 100, bulk 009 .. bulk 000
    expected = [made[i] for i in reversed(range(230)) if "00" in f"{i:03d}"]
    assert len(expected) == 12 and [s.session_id for s in page.sessions] == expected and page.next_cursor is None


@pytest.mark.parametrize(("body", "field"), [
    ({"limit": 0}, "limit"),
    ({"limit": 201}, "limit"),
    ({"statuses": []}, "statuses"),
    ({"statuses": [{"type": "sleeping"}]}, "statuses"),
    ({"statuses": [{"type": "client_finished", "reasons": ["bored"]}]}, "reasons"),
    ({"owner": {"type": "everyone"}}, "owner"),
    ({"owner": {"type": "user", "owner_urns": []}}, "owner_urns"),
    ({"display_name": ""}, "display_name"),
    ({"user_metadata": {"team": 3}}, "user_metadata"),
    ({"cursor": {"last_created_at": "2026-01-01T00:00:00", "last_session_id": "x"}}, "last_created_at"),
    ({"colour": "blue"}, "colour"),
])
def test_bad_filters_name_the_field(server_url: ServerUrl, sessions: dict[str, str], body: dict[str, Any],
                                    field: str) -> None:
    response = httpx.post(f"{server_url}/api/v1/sessions/search", headers={"X-API-Key": server_url.keys["alice"]},
                          json=body)
    assert response.status_code == 400, response.text
    assert field in response.json()["message"], response.text
