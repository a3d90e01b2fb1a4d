"""The API-key check of every request (--auth keys): keys resolved to principals (cached), 401s, the quota handler."""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from sqlalchemy import Engine, bindparam, func, select
from starlette.types import ASGIApp, Receive, Scope, Send

from skyrl_tx.api.errors import error_response
from skyrl_tx.api.ownership import QuotaExceededError
from skyrl_tx.api.principal import LOCAL, Principal
from skyrl_tx.config import ServerSettings
from skyrl_tx.db.models import ApiKeyRecord
from skyrl_tx.keys import hash_key

log = logging.getLogger("skyrl_tx.api")

CACHE_TTL_S = 1.0  # a key is re-read from the database at most this long after its last read: a revoke lands within it
CACHE_MAX = 10_000  # entries (hashes of valid and unknown keys); beyond, the cache starts over
# Open without a key: the health check, the docs, and signed download URLs (the signature is their credential, and
# the SDK's `tinker checkpoint download` fetches them without its key).
OPEN_PATHS = frozenset({"/api/v1/healthz", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
OPEN_PREFIXES = ("/api/v1/checkpoint_files/", "/api/v1/trace_files/")  # api/trace/export.py
CREATE_HINT = "an operator creates one with `skyrl-tx keys create --name NAME`"


KEY_BY_HASH = select(ApiKeyRecord.id, ApiKeyRecord.name, ApiKeyRecord.admin, ApiKeyRecord.max_live_models,
                     ApiKeyRecord.max_inflight_requests, ApiKeyRecord.revoked_at).where(
    ApiKeyRecord.key_hash == bindparam("hash_"))


class KeyRing:
    """API keys resolved to principals, each cached CACHE_TTL_S: a request costs a sha256 and a dict lookup; the
    database is read once a second per key in use. Unknown and revoked keys are cached the same way."""

    def __init__(self, database: Engine) -> None:
        self.database = database
        self._cache: dict[str, tuple[float, Principal | str]] = {}

    def _lookup(self, digest: str) -> Principal | str:
        with self.database.connect() as db:
            row = db.execute(KEY_BY_HASH, {"hash_": digest}).one_or_none()
        if row is None:
            return f"unknown API key: this server does not know it; {CREATE_HINT}"
        if row.revoked_at is not None:
            return f"API key {row.name!r} was revoked; ask the operator for a new one"
        return Principal(row.id, row.name, row.admin, row.max_live_models, row.max_inflight_requests)

    async def resolve(self, key: str) -> Principal | str:
        """The key's principal, or why it is refused."""
        digest, now = hash_key(key), time.monotonic()
        hit = self._cache.get(digest)
        if hit is not None and hit[0] > now:
            return hit[1]
        outcome = await asyncio.to_thread(self._lookup, digest)
        if len(self._cache) >= CACHE_MAX:
            self._cache.clear()
        self._cache[digest] = (now + CACHE_TTL_S, outcome)
        return outcome


def presented_key(scope: Scope) -> str | None:
    """The SDK's X-API-Key header, else an OpenAI-style `Authorization: Bearer <key>`."""
    bearer = None
    for name, value in scope["headers"]:
        if name == b"x-api-key":
            return value.decode("latin-1").strip() or None
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                bearer = token.strip()
    return bearer


class ApiKeyAuth:
    """Puts the caller's Principal in the request state, or answers 401 before anything reads the body. A plain ASGI
    middleware (cheaper per call than BaseHTTPMiddleware); outermost, so a refused body is never read."""

    def __init__(self, app: ASGIApp, keyring: KeyRing | None) -> None:
        self.app = app
        self.keyring = keyring  # None: --auth none

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        if self.keyring is None:
            state["principal"] = LOCAL
        elif scope["path"] not in OPEN_PATHS and not scope["path"].startswith(OPEN_PREFIXES):
            key = presented_key(scope)
            outcome = (await self.keyring.resolve(key) if key else
                       "missing API key: this server requires one (--auth keys); send it in the X-API-Key header "
                       f"(the tinker SDK: TINKER_API_KEY=tml-...) or as Authorization: Bearer; {CREATE_HINT}")
            if isinstance(outcome, str):
                await error_response(401, "unauthenticated", outcome)(scope, receive, send)
                return
            state["principal"] = outcome
        await self.app(scope, receive, send)


def install_auth(app: FastAPI, settings: ServerSettings, database: Engine) -> None:
    """The key check (outermost middleware: add it after the others), the quota handler, and the startup log line."""
    keyring = KeyRing(database) if settings.auth == "keys" else None
    app.add_middleware(ApiKeyAuth, keyring=keyring)

    @app.exception_handler(QuotaExceededError)
    async def quota_exceeded(_: Request, exc: QuotaExceededError) -> JSONResponse:
        response = error_response(exc.http_status, "quota_exceeded", exc.message)
        if exc.retry_after_s is not None:  # a rate limit: the SDK waits this long and retries
            response.headers["Retry-After"] = str(exc.retry_after_s)
        return response

    if keyring is None:
        log.info("auth: none (--host %s is loopback): no API key is checked and every client acts as the one owner "
                 "of everything; for per-key isolation create keys with `skyrl-tx keys create --name NAME` and start "
                 "with --auth keys", settings.host)
        return
    with database.connect() as db:
        active = db.scalar(select(func.count()).select_from(ApiKeyRecord).where(ApiKeyRecord.revoked_at.is_(None)))
    log.info("auth: keys: every request needs an API key (X-API-Key or Authorization: Bearer); %d active key(s)%s",
             active, "" if active else f"; none yet: {CREATE_HINT}")
