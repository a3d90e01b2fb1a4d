"""Request ids and the access log: RequestContext (an X-Request-Id on every response, a contextvar that every log line
written while the request runs carries, one access-log line per request) and the log-record plumbing behind it."""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from skyrl_tx.api.trace.ring import mark_received, record_answered

HEADER = b"x-request-id"
MAX_ID_LENGTH = 128
# The request's id while it runs: in its task, and in the worker threads it hands work to (asyncio.to_thread and
# Starlette's thread pool copy the context). Log records take it from here (install_log_context).
REQUEST_ID: ContextVar[str | None] = ContextVar("skyrl_tx_request_id", default=None)

access_log = logging.getLogger("skyrl_tx.access")  # INFO; `SKYRL_TX_ACCESS_LOG=0` (or its level) turns it off
ACCESS_LOG_ENV = "SKYRL_TX_ACCESS_LOG"

# Called once per request after its response: (method, route template, status, seconds, key label) (api/metrics.py).
RequestObserver = Callable[[str, str, int, float, str], None]


def accepted_id(raw: bytes) -> str | None:
    """A client's X-Request-Id, if usable: printable ASCII, at most MAX_ID_LENGTH characters (else one is made)."""
    if not raw or len(raw) > MAX_ID_LENGTH:
        return None
    try:
        text = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        return None
    return text if text and text.isprintable() else None


class IdMaker:
    """Ids unique across processes and restarts (a random prefix) and cheap (a counter, no syscall per request)."""

    def __init__(self) -> None:
        self._prefix = os.urandom(6).hex()
        self._counter = itertools.count(1)

    def __call__(self) -> str:
        return f"{self._prefix}-{next(self._counter):x}"


def key_label(scope: Scope) -> str:
    """The caller's key as a metrics and access-log label: the name (never the secret) of the principal the API-key
    middleware put in the request state, or "" (no key check). `request.state.key_name` overrides it."""
    state = scope.get("state")
    if not state:
        return ""
    name = state.get("key_name")
    if name is None:
        name = getattr(state.get("principal"), "name", "")
    return str(name)


def route_label(scope: Scope) -> str:
    """The matched route's path template (bounded label values: ids in paths are not labels); "unmatched" else."""
    return getattr(scope.get("route"), "path", None) or "unmatched"


class RequestContext:
    """Outermost ASGI middleware (plain ASGI like BodySizeLimit: BaseHTTPMiddleware's per-call tasks and streams
    cost more than this whole class). Per request: reads or makes the id, sets REQUEST_ID, adds the response header,
    then writes the access-log line and tells `observe` (the HTTP metrics)."""

    def __init__(self, app: ASGIApp, observe: RequestObserver | None = None) -> None:
        self.app = app
        self.observe = observe
        self.new_id = IdMaker()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        mark_received(scope)  # a submitted request's arrival (api/trace/ring.py)
        request_id = None
        for name, value in scope["headers"]:
            if name == HEADER:
                request_id = accepted_id(value)
                break
        if request_id is None:
            request_id = self.new_id()
        header = (HEADER, request_id.encode("ascii"))
        status: int | None = None  # until the response starts

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", ()), header]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                # Before the last bytes go out, not after: a client can read its answer before this coroutine
                # resumes, and a trace span must not end after the client saw the answer (measured: 63 µs after).
                # The ring keeps the first stamp: _done's own stamp counts only where no last part was sent.
                record_answered(scope)
            await send(message)

        token = REQUEST_ID.set(request_id)
        try:
            await self.app(scope, receive, send_with_id)
        except BaseException:
            REQUEST_ID.reset(token)
            # not started: the outer error handler answers 500
            self._done(scope, request_id, 500 if status is None else status, started)
            REQUEST_ID.set(request_id)  # the outer error handler's log line is about this request too
            raise
        REQUEST_ID.reset(token)
        self._done(scope, request_id, 500 if status is None else status, started)

    def _done(self, scope: Scope, request_id: str, status: int, started: float) -> None:
        seconds = time.perf_counter() - started
        record_answered(scope)  # a retrieve_future that answered a finished future (api/trace/ring.py)
        key = key_label(scope)
        if self.observe is not None:
            self.observe(scope["method"], route_label(scope), status, seconds, key)
        if access_log.isEnabledFor(logging.INFO):
            state = scope.get("state") or {}
            write_access_line(scope["method"], scope["path"], status, seconds * 1e3, request_id, key or "-",
                              state.get("future_id"))


def write_access_line(method: str, path: str, status: int, ms: float, request_id: str, key: str,
                      future: str | None) -> None:
    """The access-log line, made without the caller lookup (a stack walk) that Logger.info does. Written in place:
    a writer thread saved nothing here (formatting holds the GIL either way) and, woken per line, cost the event
    loop a GIL handover per request (measured in-process on a loaded 2-core machine)."""
    record = access_log.makeRecord(access_log.name, logging.INFO, __file__, 0, "%s %s %d %.1fms request_id=%s key=%s%s",
                                   (method, path, status, ms, request_id, key, f" future={future}" if future else ""),
                                   None)
    access_log.handle(record)


# ---- log records ------------------------------------------------------------------------------------------------
class RequestIdFormatter(logging.Formatter):
    """Wraps a handler's formatter: a line written during a request ends its first line with `request_id=<id>`."""

    def __init__(self, inner: logging.Formatter | None) -> None:
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        text = self.inner.format(record)
        request_id = getattr(record, "request_id", None)
        if not request_id:
            return text
        first, newline, rest = text.partition("\n")  # before a traceback, not after it
        return f"{first} request_id={request_id}{newline}{rest}"


_previous_factory: Callable[..., logging.LogRecord] | None = None


def _record_with_request_id(*args: Any, **kwargs: Any) -> logging.LogRecord:
    assert _previous_factory is not None
    record = _previous_factory(*args, **kwargs)
    record.request_id = REQUEST_ID.get()
    return record


def install_log_context() -> None:
    """Every log record gets `request_id` (None outside a request): a record factory, so any handler sees it (a
    JSON formatter can use %(request_id)s); the root handlers' formatters get RequestIdFormatter so the plain-text
    log shows it. Idempotent (several apps in one process install it once)."""
    global _previous_factory
    if os.environ.get(ACCESS_LOG_ENV, "1") == "0":
        access_log.setLevel(logging.WARNING)
    if _previous_factory is None:
        _previous_factory = logging.getLogRecordFactory()
        logging.setLogRecordFactory(_record_with_request_id)
    for handler in logging.getLogger().handlers:
        if not isinstance(handler.formatter, RequestIdFormatter):
            handler.setFormatter(RequestIdFormatter(handler.formatter))
