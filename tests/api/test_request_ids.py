"""Request ids: X-Request-Id is echoed when the client sends a usable one and made otherwise, every response carries
it, the access log has a line per request with it (a live server's log), and every log line written while a request
runs carries it, in its worker threads too (RequestContext in an app of its own, caplog)."""

from __future__ import annotations

import asyncio
import logging
import re
import sqlite3
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from tinker import types

from skyrl_tx.api.request_ids import (MAX_ID_LENGTH, RequestContext, RequestIdFormatter, accepted_id,
                                      install_log_context)

WAIT_S = 10.0  # bound on the wait for a line the server writes just after its answer


def server_log(url: Any) -> str:
    return Path(url.log_path).read_text(errors="replace")


def wait_for_line(url: Any, pattern: str) -> str | None:
    deadline = time.monotonic() + WAIT_S
    while True:
        found = re.search(pattern, server_log(url), re.MULTILINE)
        if found or time.monotonic() > deadline:
            return found.group(0) if found else None
        time.sleep(0.1)


def test_a_sent_id_is_echoed_and_logged(http: httpx.Client, server_url: Any) -> None:
    response = http.get("/api/v1/healthz", headers={"X-Request-Id": "client-id-42 (retry 1)"})
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "client-id-42 (retry 1)"
    line = wait_for_line(server_url, r"^.*skyrl_tx\.access: GET /api/v1/healthz 200 [0-9.]+ms "
                                     r"request_id=client-id-42 \(retry 1\) key=.*$")
    assert line is not None, server_log(server_url)[-2000:]


def test_ids_are_made_when_none_or_an_unusable_one_is_sent(http: httpx.Client, server_url: Any) -> None:
    made = [http.get("/api/v1/healthz").headers["x-request-id"] for _ in range(3)]
    assert len(set(made)) == 3 and all(re.fullmatch(r"[0-9a-f]{12}-[0-9a-f]+", i) for i in made), made
    for unusable in ("x" * (MAX_ID_LENGTH + 1), b"caf\xe9-id"):  # too long; not ASCII
        got = http.get("/api/v1/healthz", headers={"X-Request-Id": unusable}).headers["x-request-id"]
        assert got != unusable and re.fullmatch(r"[0-9a-f]{12}-[0-9a-f]+", got), (unusable, got)
    accepted = "y" * MAX_ID_LENGTH
    assert http.get("/api/v1/healthz", headers={"X-Request-Id": accepted}).headers["x-request-id"] == accepted
    # errors carry it too: a 404 of the router and a typed 4xx of a route
    assert re.fullmatch(r"[0-9a-f]{12}-[0-9a-f]+", http.get("/no/such/route").headers["x-request-id"])
    refused = http.post("/api/v1/forward_backward", content=b"{}", headers={"X-Request-Id": "bad-body-1",
                                                                            "content-type": "application/json"})
    assert refused.status_code >= 400 and refused.headers["x-request-id"] == "bad-body-1"
    assert wait_for_line(server_url, r"POST /api/v1/forward_backward 4\d\d [0-9.]+ms request_id=bad-body-1 ")


def test_sdk_requests_get_access_lines_naming_their_future(tinker_env: Any, service_client: Any) -> None:
    training = service_client.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=5).result()
    datum = types.Datum(model_input=types.ModelInput.from_ints([5, 17, 300, 42]),
                        loss_fn_inputs={"target_tokens": [17, 300, 42, 7], "weights": [1.0] * 4})
    training.forward_backward([datum], "cross_entropy").result()
    line = wait_for_line(tinker_env, r"^.*POST /api/v1/forward_backward 200 [0-9.]+ms request_id=\S+ key=\S+ "
                                     r"future=\S+$")
    assert line is not None, server_log(tinker_env)[-2000:]
    # The future stores that request id (the engine's lines about it name it: engine/loop.py _named).
    database = Path(tinker_env.log_path).parent / "skyrl_tx.db"
    if database.exists():  # the SQLite case (the PostgreSQL one has its database elsewhere)
        request_id = re.search(r"request_id=(\S+)", line).group(1)
        future_id = re.search(r"future=(\S+)$", line).group(1)
        with sqlite3.connect(database) as db:
            stored = db.execute("SELECT request_id FROM futures WHERE id = ?", (future_id,)).fetchone()
        assert stored == (request_id,), (stored, line)


def test_which_ids_are_accepted() -> None:
    """What a client cannot send through h11 (blank, control characters) is refused all the same."""
    assert accepted_id(b" a b ") == "a b"
    assert accepted_id(b"z" * MAX_ID_LENGTH) == "z" * MAX_ID_LENGTH
    for unusable in (b"", b"   ", b"a\tb", b"a\x00b", b"caf\xc3\xa9", b"z" * (MAX_ID_LENGTH + 1)):
        assert accepted_id(unusable) is None, unusable


# ---- in an app of its own: every log line of a request carries its id ------------------------------------------
log = logging.getLogger("skyrl_tx.test_request_ids")


def small_app() -> FastAPI:
    app = FastAPI()
    seen: list[tuple[str, int, float, str]] = []

    @app.get("/work")
    async def work() -> dict[str, str]:
        log.info("on the event loop")
        await asyncio.to_thread(log.info, "in a worker thread")
        return {"ok": "yes"}

    @app.get("/sync")
    def sync_route() -> dict[str, str]:  # Starlette runs it in its thread pool
        log.warning("in a sync route")
        return {"ok": "yes"}

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("boom")

    app.add_middleware(RequestContext, observe=lambda method, route, status, s, key: seen.append(
        (route, status, s, key)))
    app.state.seen = seen
    return app


def call(app: FastAPI, path: str, headers: dict[str, str] | None = None) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.get(path, headers=headers or {})

    return asyncio.run(go())


def test_every_log_line_of_a_request_carries_its_id(caplog: pytest.LogCaptureFixture) -> None:
    install_log_context()
    app = small_app()
    with caplog.at_level(logging.INFO):
        first = call(app, "/work", {"X-Request-Id": "req-A"})
        second = call(app, "/sync")
        log.info("outside any request")
    assert first.headers["x-request-id"] == "req-A"
    by_message = {r.getMessage(): r for r in caplog.records}
    assert by_message["on the event loop"].request_id == "req-A"
    assert by_message["in a worker thread"].request_id == "req-A"
    assert by_message["in a sync route"].request_id == second.headers["x-request-id"]
    assert by_message["outside any request"].request_id is None
    access = [r.getMessage() for r in caplog.records if r.name == "skyrl_tx.access"]
    assert any(re.fullmatch(r"GET /work 200 [0-9.]+ms request_id=req-A key=-", m) for m in access), access
    # the plain-text log shows the id at the end of the line's first line (before a traceback)
    formatter = RequestIdFormatter(logging.Formatter("%(levelname)s %(message)s"))
    assert formatter.format(by_message["on the event loop"]) == "INFO on the event loop request_id=req-A"
    assert formatter.format(by_message["outside any request"]) == "INFO outside any request"
    assert [(route, status) for route, status, _, _ in app.state.seen] == [("/work", 200), ("/sync", 200)]


def test_a_failing_request_is_logged_as_a_500_with_its_id(caplog: pytest.LogCaptureFixture) -> None:
    install_log_context()
    app = small_app()
    with caplog.at_level(logging.INFO):
        response = call(app, "/boom", {"X-Request-Id": "req-boom"})
    assert response.status_code == 500
    access = [r.getMessage() for r in caplog.records if r.name == "skyrl_tx.access"]
    assert any(m.startswith("GET /boom 500 ") and "request_id=req-boom" in m for m in access), access
    assert app.state.seen[-1][:2] == ("/boom", 500)


def test_a_finished_futures_answer_is_stamped_before_its_last_bytes_go_out() -> None:
    """The trace's "answered" moment precedes the client's receipt: stamped when the last body message is handed to
    the server, not after that send returns (a client read its answer 63 µs before the old stamp, and a span ended
    after the SDK's own end of the run)."""
    from skyrl_tx.api.trace.ring import RequestTimings

    async def app(scope, receive, send) -> None:  # a retrieve_future answering a finished future
        scope["state"]["answered_future"] = "f-1"
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{", "more_body": True})
        await send({"type": "http.response.body", "body": b"}"})

    ring = RequestTimings()
    stamped_when_sent: list[tuple[bool, float | None]] = []

    async def server_send(message) -> None:  # what the client gets, as the server writes it
        stamped_when_sent.append((message.get("more_body", False), ring.get("f-1").answered))

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    class App:  # ring_of(scope["app"]) finds the ring on app.state
        state = type("State", (), {"request_timings": ring})()

    scope = {"type": "http", "method": "POST", "path": "/api/v1/retrieve_future", "headers": [], "state": {},
             "app": App()}
    before = time.time()
    asyncio.run(RequestContext(app)(scope, receive, server_send))
    assert [more for more, _ in stamped_when_sent] == [False, True, False]  # start, two body parts
    assert stamped_when_sent[1][1] is None  # not before the last part
    assert stamped_when_sent[2][1] is not None and stamped_when_sent[2][1] >= before  # stamped as it goes out
