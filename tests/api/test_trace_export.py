"""Session trace export through the SDK 0.38 CLI (`tinker session export-trace`): a short quickstart-like run (a
pipelined training loop, sampler weights, samples), its .pftrace parsed back with Perfetto's message definitions
(tests/support/perfetto_protos.py, the protobuf runtime): one track per training and sampling client, one span per
request sent with its phases in order inside it and inside the client's own view of the run, counter tracks; the
per-request phase times (GET .../request_timings) including a seq-order wait; another key's session is a 404."""

from __future__ import annotations

import os
import subprocess
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from client_scripts import client_argv, exited_cleanly
from keyed_server import keyed_server, service_clients
from live_server import ServerUrl
from perfetto_protos import parse_trace
from raw_futures import retrieve
from sdk_training import TOKENS, datum
from tinker import types

from skyrl_tx.api.trace.build import PHASES

KEYS = {"alice": {}, "bob": {}}
ADAM = types.AdamParams(learning_rate=1e-2)
STEPS = 3
SAMPLES = 2
SLICE_BEGIN, SLICE_END, COUNTER = 1, 2, 4


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def server_url(request: pytest.FixtureRequest, preset_cache) -> Iterator[ServerUrl]:
    with keyed_server(request.param, KEYS) as url:
        yield url


def raw(server_url: ServerUrl, name: str) -> httpx.Client:
    return httpx.Client(base_url=server_url, headers={"X-API-Key": server_url.keys[name]}, timeout=60)


@pytest.fixture(scope="module")
def run(server_url: ServerUrl) -> Iterator[dict[str, Any]]:
    """Alice's run, as the quickstart does it: requests pipelined, each step's results read after both are sent."""
    with service_clients(server_url) as clients:
        alice = clients["alice"]
        began = time.time_ns()
        training = alice.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=1).result()
        for step in range(STEPS):
            fb = training.forward_backward([datum(step)], "cross_entropy")
            optim = training.optim_step(ADAM)
            fb.result()
            optim.result()
        sampler = training.save_weights_and_get_sampling_client().result()
        for seed in range(SAMPLES):
            sampler.sample(types.ModelInput.from_ints(TOKENS[:4]), 1,
                           types.SamplingParams(max_tokens=3, seed=seed)).result()
        ended = time.time_ns()
        yield {"session_id": alice.holder.get_session_id(), "model_id": training.model_id,
               "sampler_id": sampler._sampling_session_id, "sampler": sampler, "began": began, "ended": ended}


def export_with_cli(server_url: ServerUrl, session_id: str, key: str, out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TINKER_BASE_URL": server_url, "TINKER_API_KEY": key, "TINKER_TELEMETRY": "0"}
    return subprocess.run(client_argv("-m", "tinker.cli.__main__", "-f", "json", "session", "export-trace", session_id,
                                      "--output", str(out)), env=env, capture_output=True, text=True, timeout=120)


def slices(trace: Any) -> tuple[dict[int, Any], list[dict[str, Any]], dict[int, list[tuple[int, float]]]]:
    """Tracks by uuid; request spans (depth 0 on a lane) with their child phases; counter values per track."""
    tracks = {p.track_descriptor.uuid: p.track_descriptor for p in trace.packet if p.HasField("track_descriptor")}
    stacks: dict[int, list[dict[str, Any]]] = defaultdict(list)
    spans, counters = [], defaultdict(list)
    for p in trace.packet:  # the writer emits events in time order
        if not p.HasField("track_event"):
            continue
        e = p.track_event
        if e.type == COUNTER:
            counters[e.track_uuid].append((p.timestamp, e.counter_value if e.HasField("counter_value")
                                           else e.double_counter_value))
        elif e.type == SLICE_BEGIN:
            node = {"name": e.name, "begin": p.timestamp, "track": e.track_uuid, "children": [],
                    "args": {a.name: getattr(a, a.WhichOneof("value")) for a in e.debug_annotations}}
            stack = stacks[e.track_uuid]
            (stack[-1]["children"] if stack else spans).append(node)
            stack.append(node)
        elif e.type == SLICE_END:
            stacks[e.track_uuid].pop()["end"] = p.timestamp
    assert not any(stacks.values()), "every slice ends"
    return tracks, spans, counters


def test_cli_exports_a_trace_of_every_request_with_its_phases(server_url, run, tmp_path) -> None:
    # The build runs in the background: the first poll answers pending, a later one a signed URL. (Polled here at
    # a short interval; the CLI's SDK polls every 5 s, and then finds the trace ready and up to date.)
    path = f"/api/v1/sessions/{run['session_id']}/trace_export"
    with raw(server_url, "alice") as alice:
        answers = [alice.get(path).json()]
        while answers[-1]["status"] == "pending" and len(answers) < 1200:
            time.sleep(0.05)
            answers.append(alice.get(path).json())
    assert answers[0] == {"status": "pending", "url": None, "error": None, "requests": None, "total_requests": None,
                          "truncated": None}
    ready = answers[-1]
    assert ready["status"] == "ready" and ready["requests"] == ready["total_requests"] == 2 * STEPS + 2 + SAMPLES
    assert httpx.get(ready["url"]).status_code == 200  # no key: the signature is the credential
    forged = httpx.get(ready["url"].replace("&sig=", "&sig=0"))
    assert forged.status_code == 400 and "signature" in forged.text

    out = tmp_path / "run.pftrace"
    result = export_with_cli(server_url, run["session_id"], server_url.keys["alice"], out)
    assert exited_cleanly(result.returncode, result.stderr), result.stderr[-3000:]
    tracks, spans, counters = slices(parse_trace(out.read_bytes()))

    # One top-level track per client, each request on a lane (a child track) of its client's track.
    top = {t.name: uuid for uuid, t in tracks.items() if not t.HasField("parent_uuid") and not t.HasField("counter")}
    training, sampling = f"training client {run['model_id']}", f"sampling client {run['sampler_id']}"
    assert {training, sampling} <= set(top), top
    assert [n for n in top if n.startswith(("training client", "sampling client"))].count(training) == 1
    client_of = {span["args"]["future_id"]: tracks[tracks[span["track"]].parent_uuid].name for span in spans}

    # One span per request the run sent.
    kinds = Counter(span["name"].split(" #")[0] for span in spans)
    assert kinds == {"create_model": 1, "forward_backward": STEPS, "optim_step": STEPS,
                     "save_weights_for_sampler": 1, "sample": SAMPLES}, kinds
    assert len(client_of) == len(spans)
    for span in spans:
        assert client_of[span["args"]["future_id"]] == (sampling if span["name"] == "sample" else training)
    seq_ids = [s["args"]["seq_id"] for s in sorted(spans, key=lambda s: s["begin"]) if "seq_id" in s["args"]]
    assert seq_ids == sorted(seq_ids) and len(set(seq_ids)) == len(seq_ids) == 2 * STEPS + 1

    # Each span lies within the client's own view of the run; its phases tile it, in the documented order.
    for span in spans:
        assert run["began"] <= span["begin"] <= span["end"] <= run["ended"], span
        names = [c["name"] for c in span["children"]]
        assert names == [p for p in PHASES if p in names], names  # in order, each once
        assert names[0] == "storing the request" and names[-1] == "answering", names  # the API's moments known
        assert "computing" in names and "queued" in names
        assert span["children"][0]["begin"] == span["begin"] and span["children"][-1]["end"] == span["end"]
        for before, after in zip(span["children"], span["children"][1:]):
            assert before["begin"] <= before["end"] == after["begin"] <= after["end"]
        if span["name"].startswith(("forward_backward", "sample")):  # its compute step is timed on its own
            assert "storing the result" in names, names
        assert span["args"]["api_times"] == 1 and span["args"]["status"] == "completed"

    # Counters: requests in flight (back to 0), tokens/s of each kind, request sizes.
    by_name = {t.name: uuid for uuid, t in tracks.items() if t.HasField("counter")}
    assert set(by_name) == {"requests in flight", "training tokens/s", "prefill tokens/s", "generation tokens/s",
                            "request size (tokens)"}
    in_flight = [v for _, v in counters[by_name["requests in flight"]]]
    assert max(in_flight) >= 1 and in_flight[-1] == 0
    assert max(v for _, v in counters[by_name["training tokens/s"]]) > 0
    assert max(v for _, v in counters[by_name["prefill tokens/s"]]) > 0
    assert max(v for _, v in counters[by_name["generation tokens/s"]]) > 0
    sizes = Counter(v for _, v in counters[by_name["request size (tokens)"]])
    assert sizes[len(TOKENS) - 1] == STEPS and sizes[4] == SAMPLES, sizes  # each forward_backward, each prompt


def test_another_keys_session_is_not_found(server_url, run) -> None:
    with raw(server_url, "bob") as bob:
        for path in ("trace_export", "request_timings"):
            r = bob.get(f"/api/v1/sessions/{run['session_id']}/{path}")
            assert r.status_code == 404 and "not found" in r.text, r.text


def test_request_timings_show_a_seq_order_wait(server_url, run) -> None:
    """A request sent ahead of the one before it waits for it: its 'waiting for seq order' phase is recorded."""
    with raw(server_url, "alice") as alice:
        before = alice.get(f"/api/v1/sessions/{run['session_id']}/request_timings").json()
        last = max(r["seq_id"] for r in before["requests"] if r["seq_id"] is not None)
        adam = {"learning_rate": 1e-3}
        early = alice.post("/api/v1/optim_step", json={"model_id": run["model_id"], "seq_id": last + 2,
                                                       "adam_params": adam}).json()["request_id"]
        # A sample sent after it finishes only once a scan that also saw the early request has run: by then the
        # engine has held it back behind seq_id last + 1.
        run["sampler"].sample(types.ModelInput.from_ints(TOKENS[:4]), 1, types.SamplingParams(max_tokens=1)).result()
        gap = alice.post("/api/v1/optim_step", json={"model_id": run["model_id"], "seq_id": last + 1,
                                                     "adam_params": adam}).json()["request_id"]
        for future in (gap, early):
            assert "metrics" in retrieve(alice, future)
        after = {r["future_id"]: r for r in alice.get(f"/api/v1/sessions/{run['session_id']}/request_timings")
                 .json()["requests"]}
    held, filler = after[early], after[gap]
    assert held["times"]["ordered"] is not None and filler["times"]["ordered"] is None
    assert list(held["phases_s"])[:3] == ["storing the request", "waiting for seq order", "queued"]
    assert "waiting for seq order" not in filler["phases_s"]
    assert held["times"]["ordered"] >= filler["times"]["stored"]  # it became runnable once the gap was filled
    assert all(r["times"]["answered"] is not None for r in after.values())


def test_a_failed_build_is_reported_once_then_built_again() -> None:
    from skyrl_tx.api.trace.build import BuiltTrace
    from skyrl_tx.api.trace.jobs import TraceJobs

    jobs, calls = TraceJobs(), []

    def build() -> BuiltTrace:
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("no database")
        return BuiltTrace(b"", 0, 0, False)

    def settled() -> str:
        for _ in range(2000):
            job = jobs.poll("s", (1,), build)
            if job.status != "pending":
                return f"{job.status}: {job.error}"
            time.sleep(0.01)
        raise AssertionError("never built")

    assert jobs.poll("s", (1,), build).status == "pending"
    assert settled() == "failed: building the trace failed: ValueError: no database"
    assert settled() == "ready: None" and len(calls) == 2  # the poll after the failure built again
