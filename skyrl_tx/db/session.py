"""Engine and session factories for SQLite (default, one file in the data directory) and PostgreSQL.

SQLite connections get `journal_mode=WAL` (readers never block the writer), `synchronous=NORMAL` (no
fsync per commit; safe against process crashes), `busy_timeout=5000` (wait for
the write lock instead of failing at once) and `foreign_keys=ON` (off by default in SQLite), and may be
used from any thread (`check_same_thread=False`; the pool hands a connection to one thread at a time).

Note on SQLite transactions: Python's sqlite3 driver opens a transaction only at the first write, so a
SELECT followed by an UPDATE is not one atomic step. Claim work with a conditional UPDATE
(`... WHERE status = 'pending'`, checking the row count) rather than read-then-write.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.orm import Session, sessionmaker

from skyrl_tx.finite_json import dumps_finite

DATA_DIR_ENV = "SKYRL_TX_DATA_DIR"
DATABASE_FILE = "skyrl_tx.db"
SQLITE_BUSY_TIMEOUT_MS = 5000


def default_data_dir() -> Path:
    """$SKYRL_TX_DATA_DIR, else $XDG_DATA_HOME/skyrl_tx, else ~/.local/share/skyrl_tx (not created here)."""
    if os.environ.get(DATA_DIR_ENV):
        return Path(os.environ[DATA_DIR_ENV]).expanduser()
    xdg = os.environ.get("XDG_DATA_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".local" / "share") / "skyrl_tx"


def default_database_url(data_dir: str | os.PathLike[str] | None = None) -> str:
    """sqlite:///<data_dir>/skyrl_tx.db (data_dir defaults to default_data_dir()); creates the directory."""
    directory = Path(data_dir).expanduser() if data_dir is not None else default_data_dir()
    directory.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{(directory / DATABASE_FILE).resolve()}"


def normalize_url(url: str | URL) -> URL:
    """Parses `url`; plain postgresql:// (and postgres://) URLs get the installed driver, psycopg 3."""
    if isinstance(url, str) and url.startswith("postgres://"):
        url = "postgresql://" + url[len("postgres://"):]
    parsed = make_url(url)
    if parsed.drivername == "postgresql":
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


def is_sqlite(url: str | URL) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


def sqlite_file(url: str | URL) -> Path | None:
    """The database file of a SQLite URL; None for in-memory databases and other backends."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return None
    if parsed.database.startswith("file:"):  # sqlite URI filenames (?uri=true) are left to the driver
        return None
    return Path(parsed.database)


def ensure_sqlite_directory(url: str | URL) -> None:
    """Creates the parent directory of a SQLite database file, so a fresh data dir just works."""
    path = sqlite_file(url)
    if path is not None:
        path.expanduser().parent.mkdir(parents=True, exist_ok=True)


def _sqlite_on_connect(dbapi_connection: Any, _record: Any) -> None:
    # Runs before any transaction is open: PRAGMA foreign_keys is a no-op inside one.
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA journal_mode=WAL")
        # WAL + NORMAL: no fsync per commit (only at checkpoints). A crashed process loses nothing; a power
        # cut may lose the last transactions. Production deployments that need more use PostgreSQL.
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA foreign_keys=ON")
    finally:
        cursor.close()


def make_engine(url: str | URL, **kwargs: Any) -> Engine:
    """A SQLAlchemy engine for `url` with the per-backend settings above; kwargs go to create_engine."""
    parsed = normalize_url(url)
    kwargs.setdefault("json_serializer", dumps_finite)  # a NaN result (diverged model) is stored, not refused
    if parsed.get_backend_name() == "sqlite":
        ensure_sqlite_directory(parsed)
        connect_args = {"check_same_thread": False, **kwargs.pop("connect_args", {})}
        engine = create_engine(parsed, connect_args=connect_args, **kwargs)
        event.listen(engine, "connect", _sqlite_on_connect)
        return engine
    kwargs.setdefault("pool_pre_ping", True)  # survive server restarts and idle-connection timeouts
    return create_engine(parsed, **kwargs)


def bound_engine(sessions: sessionmaker[Session]) -> Engine:
    """The Engine a session factory is bound to. The futures hot path runs its prebuilt Core statements on plain
    connections of it: an ORM Session around one statement costs about as much again as the statement."""
    engine = sessions.kw["bind"]
    assert isinstance(engine, Engine), "session factory is not bound to an Engine"
    return engine


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    """Sessions bound to `engine`; objects stay readable after commit (expire_on_commit=False)."""
    return sessionmaker(bind=engine, expire_on_commit=False)
