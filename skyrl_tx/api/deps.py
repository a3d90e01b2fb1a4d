"""Request-scoped dependencies: the settings, a DB session, and the engine's wake-up call."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Annotated, TypeVar

from fastapi import Depends, Request
from sqlalchemy import Connection
from sqlalchemy.orm import Session

from skyrl_tx.config import ServerSettings

T = TypeVar("T")


def get_settings(request: Request) -> ServerSettings:
    return request.app.state.settings


def get_db(request: Request) -> Iterator[Session]:
    with request.app.state.session_factory() as db:
        yield db


async def in_db(request: Request, work: Callable[[Connection], T]) -> T:
    """Runs `work` with a database connection in a worker thread. The hot routes (forward_backward, optim_step,
    asample) use it from an `async def`: one thread hop per call, where a sync route with the DbDep generator
    dependency takes three (dependency enter, route, dependency exit). A Core connection, not an ORM Session:
    the hot routes run prebuilt Core statements only (db/future_queries.py)."""
    def run() -> T:
        with request.app.state.database.connect() as db:
            return work(db)

    return await asyncio.to_thread(run)


SettingsDep = Annotated[ServerSettings, Depends(get_settings)]
DbDep = Annotated[Session, Depends(get_db)]
