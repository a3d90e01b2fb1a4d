"""Request-scoped dependencies: the settings, a DB session, and the engine's wake-up call."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from skyrl_tx.config import ServerSettings


def get_settings(request: Request) -> ServerSettings:
    return request.app.state.settings


def get_db(request: Request) -> Iterator[Session]:
    with request.app.state.session_factory() as db:
        yield db


SettingsDep = Annotated[ServerSettings, Depends(get_settings)]
DbDep = Annotated[Session, Depends(get_db)]
