"""The web console (/console): server-rendered pages over the API's own route functions (pages.py, admin.py), signed
in by a cookie the gate hands to the API-key check (gate.py). install_console() is all create_app calls."""

from __future__ import annotations

from fastapi import FastAPI
from sqlalchemy import Engine

from skyrl_tx.api.auth import KeyRing
from skyrl_tx.api.console import admin, pages
from skyrl_tx.api.console.gate import ConsoleGate, open_pages
from skyrl_tx.api.console.session_metrics import StepCache
from skyrl_tx.config import ServerSettings


def install_console(app: FastAPI, settings: ServerSettings, database: Engine) -> None:
    """The console's routes and its gate. Call it right after install_auth: the gate must sit just outside the key
    check (it hands the cookie's key to it), inside the request-id / access-log middleware."""
    keyring = KeyRing(database) if settings.auth == "keys" else None
    app.state.console_steps = StepCache()
    app.include_router(pages.router)
    app.include_router(admin.router)
    app.add_middleware(ConsoleGate, keyring=keyring, open_pages=open_pages(keyring))
