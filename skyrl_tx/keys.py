"""API keys: make (shown once, stored as a sha256), list and revoke them in the server's database."""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone

from sqlalchemy import or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from skyrl_tx.db import audit, migrate
from skyrl_tx.db.models import ApiKeyRecord
from skyrl_tx.db.session import make_engine, make_session_factory
from skyrl_tx.errors import ConflictError, InvalidArgumentError, NotFoundError

KEY_PREFIX = "tml-"  # the tinker SDK refuses keys without it
SHOWN_PREFIX_CHARS = 10  # of a key kept in clear (`keys list`): "tml-" and 6 random characters


def hash_key(key: str) -> str:
    """sha256 hex of the whole key. A plain hash suffices: keys carry 256 random bits, so no table of guesses
    can find one (a slow password hash would only slow every request down)."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)  # 32 random bytes


@dataclass(frozen=True)
class KeyInfo:
    """A key as `keys list` shows it (never the key)."""

    id: str
    name: str
    key_prefix: str
    admin: bool
    max_live_models: int | None
    max_inflight_requests: int | None
    created_at: datetime
    revoked_at: datetime | None

    @classmethod
    def of(cls, row: ApiKeyRecord) -> KeyInfo:
        return cls(row.id, row.name, row.key_prefix, row.admin, row.max_live_models, row.max_inflight_requests,
                   row.created_at, row.revoked_at)


@contextmanager
def _db(database_url: str) -> Iterator[Session]:
    migrate.upgrade(database_url)  # the keys table may not exist yet: the server has never started on it
    engine = make_engine(database_url)
    try:
        with make_session_factory(engine)() as db:
            yield db
    finally:
        engine.dispose()


def _check_quota(value: int | None, flag: str) -> None:
    if value is not None and value < 1:
        raise InvalidArgumentError(f"{flag} must be >= 1 (got {value}); leave it out for no limit")


def create_key(database_url: str, name: str, *, admin: bool = False, max_live_models: int | None = None,
               max_inflight_requests: int | None = None) -> tuple[str, KeyInfo]:
    """A new key named `name` (unique); returns the key itself (not stored anywhere) and its record."""
    if not name.strip():
        raise InvalidArgumentError("keys create: --name must not be empty")
    _check_quota(max_live_models, "--max-live-models")
    _check_quota(max_inflight_requests, "--max-inflight-requests")
    key = new_key()
    row = ApiKeyRecord(id="key-" + secrets.token_hex(6), name=name, key_hash=hash_key(key),
                       key_prefix=key[:SHOWN_PREFIX_CHARS], admin=admin, max_live_models=max_live_models,
                       max_inflight_requests=max_inflight_requests)
    with _db(database_url) as db:
        if db.scalar(select(ApiKeyRecord.id).where(ApiKeyRecord.name == name)) is not None:
            raise ConflictError(f"keys create: a key named {name!r} exists already (names stay taken after a "
                                "revoke); choose another --name")
        db.add(row)
        try:
            audit.record(db, "key_create", actor=None, owner=row.id, resource=row.id,  # None: the command line
                         details={"name": name, "admin": admin})
            db.commit()
        except IntegrityError as exc:  # a concurrent create of the same name
            raise ConflictError(f"keys create: a key named {name!r} exists already; choose another --name") from exc
        return key, KeyInfo.of(row)


def key_infos(db: Session) -> list[KeyInfo]:
    """Every key, oldest first (`keys list`, the console's keys page)."""
    return [KeyInfo.of(r) for r in db.scalars(select(ApiKeyRecord).order_by(ApiKeyRecord.created_at))]


def list_keys(database_url: str) -> list[KeyInfo]:
    with _db(database_url) as db:
        return key_infos(db)


def revoke_key(database_url: str, name_or_id: str) -> KeyInfo:
    """Marks the key revoked: its next call gets a 401 (the server re-reads a key at least once a second)."""
    with _db(database_url) as db:
        row = db.scalar(select(ApiKeyRecord).where(or_(ApiKeyRecord.name == name_or_id,
                                                       ApiKeyRecord.id == name_or_id)))
        if row is None:
            raise NotFoundError(f"keys revoke: no key named {name_or_id!r} (nor with that id); see "
                                "`skyrl-tx keys list`")
        revoke(db, row, actor=None)
        return KeyInfo.of(row)


def revoke(db: Session, row: ApiKeyRecord, *, actor: str | None, request_id: str | None = None) -> None:
    """Revokes `row` (once: a second revoke changes nothing) with its audit entry, in one commit. `actor`: the key
    that asked (DELETE /api/v1/auth/apikey/me: the key itself), None for the command line."""
    if row.revoked_at is None:
        row.revoked_at = datetime.now(timezone.utc)
        audit.record(db, "key_revoke", actor=actor, owner=row.id, resource=row.id, request_id=request_id,
                     details={"name": row.name})
        db.commit()
