"""create_app: the FastAPI application (routes, error handlers) and its lifespan (database, engine thread)."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from skyrl_tx.api.errors import error_response, install_error_handlers
from skyrl_tx.api.routes import checkpoints, futures, sampling, service, training, training_runs
from skyrl_tx.api.waiters import FutureWaiters
from skyrl_tx.config import ServerSettings
from skyrl_tx.db import migrate
from skyrl_tx.db.future_queries import Notify
from skyrl_tx.checkpoints.store import CheckpointStore, default_checkpoints_base
from skyrl_tx.db.session import default_database_url, make_engine, make_session_factory
from skyrl_tx.engine.process import EngineProcess
from skyrl_tx.engine.settings import EngineSettings

log = logging.getLogger("skyrl_tx.api")


class BodySizeLimit:
    """413 for a declared body above the limit, before anything reads it. A plain ASGI middleware: Starlette's
    BaseHTTPMiddleware wraps every request and response in extra tasks and streams (a measurable part of the
    per-call overhead that `python -m skyrl_tx.bench api` reports)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            for name, value in scope["headers"]:
                if name == b"content-length":
                    if value.isdigit() and int(value) > self.max_bytes:
                        response = error_response(413, "invalid_argument", f"request body of {int(value)} bytes "
                                                  f"exceeds the limit of {self.max_bytes}; send fewer datums per call")
                        await response(scope, receive, send)
                        return
                    break
        await self.app(scope, receive, send)


def start_engine(settings: ServerSettings, engine_settings: EngineSettings,
                 on_finished: Notify) -> Any:
    """The engine host for settings.engine (the API itself never imports the extension)."""
    if settings.engine == "process":
        return EngineProcess([json.dumps(engine_settings.to_json()), "--stdio"], on_finished=on_finished)
    from skyrl_tx.engine.runner import EngineRunner, ExternalEngine  # loads torch: only for these two modes

    if settings.engine == "thread":
        return EngineRunner(engine_settings, on_finished=on_finished)
    return ExternalEngine()


def create_app(settings: ServerSettings, model_dir: Path, architecture: str) -> FastAPI:
    database_url = settings.database_url or default_database_url()
    migrate.upgrade(database_url)  # migrations are the only way the schema is created
    engine = make_engine(database_url)
    session_factory = make_session_factory(engine)
    waiters = FutureWaiters()
    checkpoints_base = settings.checkpoints_base or default_checkpoints_base()
    store = CheckpointStore(checkpoints_base, settings.checkpoints_storage_options)
    engine_settings = EngineSettings.for_server(settings, model_dir, database_url, checkpoints_base)
    runner = start_engine(settings, engine_settings, waiters.notify_threadsafe)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        waiters.bind(asyncio.get_running_loop())
        runner.start()
        await asyncio.to_thread(runner.ready.wait)
        if runner.failed is not None:
            raise RuntimeError(f"the engine could not load the base model: {runner.failed}")
        log.info("engine ready (%s%s): serving %s", settings.engine, f", pid {runner.pid}" if runner.pid else "",
                 ", ".join([settings.base_model, *settings.model_aliases]))
        yield
        runner.stop()
        engine.dispose()

    app = FastAPI(title="skyrl_tx", lifespan=lifespan)
    app.state.settings = settings
    app.state.session_factory = session_factory
    app.state.database = engine  # Core connections for the futures hot path (api/deps.py in_db)
    app.state.waiters = waiters
    app.state.store = store
    app.state.download_secret = secrets.token_bytes(32)  # signs checkpoint download URLs of this server run
    app.state.wake_engine = runner.wake
    app.state.engine = runner
    app.state.model_dir = model_dir
    app.state.architecture = architecture
    install_error_handlers(app)

    app.add_middleware(BodySizeLimit, max_bytes=settings.max_request_bytes)
    for router in (service.router, training.router, sampling.router, futures.router, checkpoints.router,
                   training_runs.router):
        app.include_router(router)
    return app
