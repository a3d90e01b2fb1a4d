"""join_sampling_session through the real SDK: with the client config's sample_join_sampling_session on, a copy of a
sampling client (unpickled, or made from a sampler handle) asks the server for its number once, before its first
sample, and numbers its requests in that block; copies sample the same weights as the original, sync and async.
Which requests ran under which number is read from the server's access log (future=<sampler>:<seq_id>)."""

from __future__ import annotations

import asyncio
import base64
import json
import pickle
import re
from typing import Any

import pytest
import tinker
from live_server import ServerUrl
from tinker import types

from skyrl_tx.api.routes.sampling_clients import FIRST_JOINED, SEQ_IDS_PER_CLIENT

BASE_MODEL = "tiny-qwen3"
PROMPT = types.ModelInput.from_ints([5, 17, 300, 42, 7])
PARAMS = types.SamplingParams(max_tokens=6, temperature=1.0, seed=11)
API_KEY = "tml-test"  # tests/api/conftest.py's


@pytest.fixture(scope="module")
def sampler(service_client: Any) -> Any:
    return service_client.create_sampling_client(base_model=BASE_MODEL).result()


def sampler_id(client: Any) -> str:
    """The sampling session a client samples from, as its (cross-process) handle carries it."""
    return json.loads(base64.urlsafe_b64decode(client.get_sampler_handle()))["sampling_session_id"]


def seq_ids(server_url: ServerUrl, sampler_session: str) -> list[int]:
    """The seq_ids of every sample request the server accepted for this sampling session, in log order."""
    pattern = re.compile(rf"POST /api/v1/asample 200 .* future={re.escape(sampler_session)}:(\d+)")
    return [int(m.group(1)) for m in pattern.finditer(server_url.log_path.read_text(errors="replace"))]


def joins(server_url: ServerUrl) -> int:
    return server_url.log_path.read_text(errors="replace").count("POST /api/v1/join_sampling_session 200")


def tokens(response: types.SampleResponse) -> list[int]:
    return list(response.sequences[0].tokens)


def test_the_client_config_turns_joining_on(http: Any) -> None:
    assert http.post("/api/v1/client/config", json={}).json()["sample_join_sampling_session"] is True


def test_the_client_config_leaves_the_retrieve_futures_poll_off_by_default(http: Any) -> None:
    """SDK 0.38's retrieve_futures poller can hang a ServiceClient's close (config.py says how); a server started
    without --sample-retrieve-futures sends its clients down the per-request retrieve_future poll."""
    assert http.post("/api/v1/client/config", json={}).json()["sample_use_retrieve_futures"] is False


def test_copies_get_their_own_numbers_and_sample_the_same_weights(server_url: ServerUrl, sampler: Any) -> None:
    expected = tokens(sampler.sample(PROMPT, 1, PARAMS).result())
    joined_before = joins(server_url)
    unpickled = pickle.loads(pickle.dumps(sampler))
    from_handle = tinker.SamplingClient.from_sampler_handle(sampler.get_sampler_handle(), api_key=API_KEY)
    for copy in (unpickled, from_handle):
        assert tokens(copy.sample(PROMPT, 1, PARAMS).result()) == expected
        assert tokens(copy.sample(PROMPT, 1, PARAMS).result()) == expected
    assert joins(server_url) == joined_before + 2  # one join per copy, before its first sample only
    blocks: dict[int, list[int]] = {}
    for seq_id in seq_ids(server_url, sampler_id(sampler)):
        blocks.setdefault(seq_id // SEQ_IDS_PER_CLIENT, []).append(seq_id % SEQ_IDS_PER_CLIENT)
    original, *copies = sorted(blocks)
    assert original == 0 and len(copies) == 2 and all(block >= FIRST_JOINED for block in copies), blocks
    assert [blocks[block] for block in copies] == [[0, 1], [0, 1]]


def test_an_async_copy_joins_once_for_concurrent_samples(server_url: ServerUrl, sampler: Any) -> None:
    expected = tokens(sampler.sample(PROMPT, 1, PARAMS).result())
    joined_before = joins(server_url)
    before = set(seq_ids(server_url, sampler_id(sampler)))

    async def sample_concurrently() -> list[types.SampleResponse]:
        copy = pickle.loads(pickle.dumps(sampler))
        return await asyncio.gather(*[copy.sample(PROMPT, 1, PARAMS) for _ in range(4)])

    results = asyncio.run(sample_concurrently())
    assert [tokens(r) for r in results] == [expected] * 4
    assert joins(server_url) == joined_before + 1
    new = sorted(set(seq_ids(server_url, sampler_id(sampler))) - before)
    assert len({seq_id // SEQ_IDS_PER_CLIENT for seq_id in new}) == 1 and new[0] // SEQ_IDS_PER_CLIENT >= FIRST_JOINED
    assert [seq_id % SEQ_IDS_PER_CLIENT for seq_id in new] == [0, 1, 2, 3]


def test_joins_number_upwards_and_refuse_unknown_sampling_sessions(http: Any, sampler: Any) -> None:
    first, second = (http.post("/api/v1/join_sampling_session", json={"sampling_session_id": sampler_id(sampler)})
                     for _ in range(2))
    assert first.status_code == second.status_code == 200, first.text
    assert second.json()["client_counter"] == first.json()["client_counter"] + 1 > FIRST_JOINED
    missing = http.post("/api/v1/join_sampling_session", json={"sampling_session_id": "nope:sample:0"})
    assert missing.status_code == 404 and "nope:sample:0" in missing.json()["message"]
    no_id = http.post("/api/v1/join_sampling_session", json={})
    assert no_id.status_code == 400 and "sampling_session_id" in no_id.json()["message"]
