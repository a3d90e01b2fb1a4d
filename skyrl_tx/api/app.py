"""create_app: the FastAPI application (routes, error handlers) and its lifespan (database, engine thread)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from skyrl_tx import __version__
from skyrl_tx.api.auth import install_auth
from skyrl_tx.api.console import install_console
from skyrl_tx.api.errors import error_response, install_error_handlers
from skyrl_tx.api.metrics import Metrics
from skyrl_tx.api.openapi import install_openapi
from skyrl_tx.api.submit import record_unusable_body
from skyrl_tx.api.url_signing import signing_secret
from skyrl_tx.api.routes import checkpoints, custom_losses, futures, futures_batch, sampling, sampling_clients, service
from skyrl_tx.api.routes import audit_log, identity, session_info, sessions, usage
from skyrl_tx.api.routes import training, training_runs, weight_copies
from skyrl_tx.api.routes import openai_compat
from skyrl_tx.api.trace import export as trace_export
from skyrl_tx.api.trace.jobs import TraceJobs
from skyrl_tx.api.trace.ring import RequestTimings
from skyrl_tx.api.waiters import FutureWaiters
from skyrl_tx.config import ServerSettings
from skyrl_tx.db import migrate
from skyrl_tx.db.future_queries import Notify
from skyrl_tx.checkpoints.store import CheckpointStore, default_checkpoints_base
from skyrl_tx.db.session import default_data_dir, default_database_url, make_engine, make_session_factory
from skyrl_tx.engine.process import EngineProcess
from skyrl_tx.engine.settings import EngineSettings
from skyrl_tx.errors import InvalidArgumentError
from skyrl_tx.models.hf_config import load_decoder_config

log = logging.getLogger("skyrl_tx.api")


class BodyTooLarge(HTTPException):
    """Raised by BodySizeLimit's receive once more body bytes arrived than the limit allows."""

    def __init__(self) -> None:
        super().__init__(status_code=413)


class BodySizeLimit:
    """413 for a body above the limit: a declared one (Content-Length) before anything reads it, and any body
    (chunked, or a Content-Length that lies) as soon as the bytes received pass the limit, so at most the limit
    is ever held. A plain ASGI middleware: Starlette's BaseHTTPMiddleware wraps every request and response in
    extra tasks and streams (a measurable part of the per-call overhead that `python -m skyrl_tx.bench api`
    reports)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def _too_large(self, scope: Scope, receive: Receive, send: Send, size: str, prefix: bytes) -> None:
        message = f"request body of {size} bytes exceeds the limit of {self.max_bytes}; send fewer datums per call"
        if prefix:  # a forward_backward: its seq_id is consumed all the same (api/submit.py)
            encoding = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"content-encoding"), None)
            await asyncio.to_thread(record_unusable_body, Request(scope), prefix, encoding,
                                    InvalidArgumentError(message))
        await error_response(413, "invalid_argument", message)(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        keep_prefix = scope["path"] == FORWARD_BACKWARD_PATH
        for name, value in scope["headers"]:
            if name == b"content-length":
                if value.isdigit() and int(value) > self.max_bytes:
                    prefix = await _read_prefix(receive) if keep_prefix else b""
                    await self._too_large(scope, receive, send, str(int(value)), prefix)
                    return
                break
        received, exceeded, started, prefix = 0, False, False, bytearray()

        async def counted_receive() -> Message:
            nonlocal received, exceeded
            message = await receive()
            if message["type"] == "http.request":
                chunk = message.get("body", b"")
                received += len(chunk)
                if keep_prefix and len(prefix) < PREFIX_LIMIT:
                    prefix.extend(chunk[: PREFIX_LIMIT - len(prefix)])
                if received > self.max_bytes:
                    exceeded = True
                    raise BodyTooLarge()
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if exceeded:  # whatever the app made of the cut-off body, the client gets the 413 instead
                return
            started = True
            await send(message)

        try:
            await self.app(scope, counted_receive, guarded_send)
        except BodyTooLarge:
            pass
        if exceeded and not started:
            await self._too_large(scope, receive, send, f"more than {self.max_bytes}", bytes(prefix))


FORWARD_BACKWARD_PATH = "/api/v1/forward_backward"
PREFIX_LIMIT = 1024 * 1024  # of a refused forward_backward body kept to read its model_id and seq_id from
PREFIX_WAIT_S = 2.0  # a client that announced a too-large body but sends none gets its 413 after this


async def _read_prefix(receive: Receive) -> bytes:
    """The first bytes of a body announced too large, as far as they arrive promptly (the SDK sends its body with
    its headers; a client waiting for the answer first gets it after PREFIX_WAIT_S)."""
    prefix = bytearray()
    deadline = asyncio.get_running_loop().time() + PREFIX_WAIT_S
    while len(prefix) < PREFIX_LIMIT:
        remaining = deadline - asyncio.get_running_loop().time()
        if remaining <= 0:
            break
        try:
            message = await asyncio.wait_for(receive(), remaining)
        except TimeoutError:
            break
        if message["type"] != "http.request":
            break
        prefix.extend(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return bytes(prefix[:PREFIX_LIMIT])


def start_engine(settings: ServerSettings, engine_settings: EngineSettings,
                 on_finished: Notify) -> Any:
    """The engine host for settings.engine (the API itself never imports the extension)."""
    if settings.engine == "process":
        return EngineProcess(json.dumps(engine_settings.to_json()), on_finished=on_finished)
    from skyrl_tx.engine.runner import EngineRunner, ExternalEngine  # loads torch: only for these two modes

    if settings.engine == "thread":
        return EngineRunner(engine_settings, on_finished=on_finished)
    return ExternalEngine()


def create_app(settings: ServerSettings, model_dir: Path, architecture: str) -> FastAPI:
    settings.validate()
    # The model directory is one more name of the base model: the SDK's SamplingClient.get_tokenizer() loads the
    # tokenizer from the base model's *name* (AutoTokenizer.from_pretrained), and a preset name such as tiny-qwen3 is
    # on no hub, while a path works offline wherever the client sees the directory (README: Tokenizers).
    settings = settings.also_serving(str(model_dir))
    database_url = settings.database_url or default_database_url()
    log.info("%s", migrate.upgrade_quietly(database_url))  # migrations are the only way the schema is created
    engine = make_engine(database_url)
    session_factory = make_session_factory(engine)
    waiters = FutureWaiters()
    checkpoints_base = settings.checkpoints_base or default_checkpoints_base()
    store = CheckpointStore(checkpoints_base, settings.checkpoints_storage_options)
    engine_settings = EngineSettings.for_server(settings, model_dir, database_url, checkpoints_base)
    metrics = Metrics(engine)  # per app (api/metrics.py); counts the database's errors
    runner = start_engine(settings, engine_settings, metrics.engine_events(waiters.notify_threadsafe,
                                                                                waiters.progress_threadsafe))

    async def watch_engine_start(app: FastAPI) -> None:
        """The server serves while the engine loads the base model and rebuilds the live models (requests wait
        in the database meanwhile). An engine that cannot start is a configuration problem: the server stops."""
        await asyncio.to_thread(runner.ready.wait)
        if runner.failed is not None:
            app.state.engine_failed = f"the engine could not load the base model: {runner.failed}"
            log.error("%s; stopping the server", app.state.engine_failed)
            # uvicorn shuts down gracefully, then re-raises the signal: the process ends non-zero (143)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        log.info("engine ready (%s%s): serving %s", settings.engine, f", pid {runner.pid}" if runner.pid else "",
                 ", ".join(settings.served_names()))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        waiters.bind(asyncio.get_running_loop())
        runner.start()
        watcher = asyncio.create_task(watch_engine_start(app))
        yield
        watcher.cancel()
        runner.stop()
        engine.dispose()

    app = FastAPI(title="skyrl_tx", version=__version__, lifespan=lifespan)
    app.state.settings = settings
    app.state.session_factory = session_factory
    app.state.database = engine  # Core connections for the futures hot path (api/deps.py in_db)
    app.state.waiters = waiters
    app.state.store = store
    app.state.download_secret = signing_secret(settings.url_signing_secret, default_data_dir())
    app.state.wake_engine = runner.wake
    app.state.engine = runner
    app.state.model_dir = model_dir
    app.state.architecture = architecture
    app.state.engine_failed = None  # set when the engine could not start (healthz says so)
    app.state.key_metrics = metrics.keys  # routes report accepted tokens per key (api/key_metrics.py)
    app.state.metrics = metrics  # retrieve_future counts a long poll that was not woken (api/routes/futures.py)
    app.state.request_timings = RequestTimings()  # the API's per-request moments (api/trace/ring.py)
    app.state.trace_jobs = TraceJobs()  # session trace exports being built or kept (api/trace/jobs.py)
    # forward / forward_backward sequences longer than the model's positions are refused at the edge
    app.state.max_positions = load_decoder_config(model_dir).max_position_embeddings
    install_error_handlers(app)

    app.add_middleware(BodySizeLimit, max_bytes=settings.max_request_bytes)
    install_auth(app, settings, engine)  # the API-key check, outermost: a refused request's body is never read
    install_console(app, settings, engine)  # /console: its gate sits just outside the key check
    for router in (service.router, sessions.router, training.router, custom_losses.router, sampling.router,
                   sampling_clients.router, futures.router, futures_batch.router, checkpoints.router,
                   weight_copies.router, training_runs.router, openai_compat.router, session_info.router,
                   identity.router, audit_log.router, usage.router, trace_export.router):
        app.include_router(router)
    metrics.install(app, runner)  # GET /metrics; request ids and the access log: last, its middleware is outermost
    install_openapi(app)
    return app
