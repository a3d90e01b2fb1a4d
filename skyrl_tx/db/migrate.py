"""Schema migrations through Alembic's command API, with a programmatic Config (no alembic.ini).

The migration scripts ship inside the wheel as `skyrl_tx/migrations` (pyproject maps the repository's
top-level `migrations/` there); an editable install uses the repository's `migrations/` directly.
This is the only way the schema is created: `metadata.create_all` is never called at runtime.
"""

from __future__ import annotations

import logging

import importlib.resources
import re
import tempfile
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import Script, ScriptDirectory
from sqlalchemy import create_engine, pool
from sqlalchemy.engine import URL

from skyrl_tx.db.session import ensure_sqlite_directory, normalize_url

# Revision files: migrations/versions/2026_11_22_0001_initial_schema.py (date, sequential id, slug).
FILE_TEMPLATE = "%(year)d_%(month).2d_%(day).2d_%(rev)s_%(slug)s"
_SEQUENTIAL_REV = re.compile(r"^\d{4}$")


def migrations_dir() -> Path:
    """The directory holding env.py and versions/: the packaged copy, else the repository's migrations/."""
    candidates: list[Path] = []
    try:
        packaged = importlib.resources.files("skyrl_tx").joinpath("migrations")
        candidates.append(Path(str(packaged)))
    except (ModuleNotFoundError, TypeError, ValueError):
        pass
    import skyrl_tx

    candidates.append(Path(skyrl_tx.__file__).resolve().parent.parent / "migrations")  # editable / source tree
    for candidate in candidates:
        if (candidate / "env.py").is_file() and (candidate / "versions").is_dir():
            return candidate
    raise FileNotFoundError("skyrl_tx migrations not found (looked in " + ", ".join(map(str, candidates))
                            + "); reinstall skyrl-tx: the wheel maps migrations/ to skyrl_tx/migrations")


def _url_string(url: str | URL) -> str:
    return normalize_url(url).render_as_string(hide_password=False)


def make_config(url: str | URL | None = None) -> Config:
    """An Alembic Config pointing at the migrations, with `url` as the "sqlalchemy.url" main option."""
    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    config.set_main_option("file_template", FILE_TEMPLATE.replace("%", "%%"))
    config.set_main_option("path_separator", "os")
    if url is not None:
        # The option goes through ConfigParser interpolation: escape '%' (URL-encoded passwords, options).
        config.set_main_option("sqlalchemy.url", _url_string(url).replace("%", "%%"))
    return config


def upgrade(url: str | URL, revision: str = "head") -> None:
    """Migrates the database at `url` up to `revision` (creating it, for SQLite, if missing)."""
    ensure_sqlite_directory(url)
    command.upgrade(make_config(url), revision)


def upgrade_quietly(url: str | URL) -> str:
    """upgrade() to head without Alembic's per-step INFO lines; returns the one line a server logs about it."""
    ensure_sqlite_directory(url)
    before = current(url)
    alembic_log = logging.getLogger("alembic")
    level = alembic_log.level
    alembic_log.setLevel(logging.WARNING)
    try:
        upgrade(url)
    finally:
        alembic_log.setLevel(level)
    after = current(url)
    shown = normalize_url(url).render_as_string(hide_password=True)
    change = "up to date" if before == after else f"migrated from {before or 'an empty database'}"
    return f"database: {shown} at revision {after} ({change})"


def downgrade(url: str | URL, revision: str) -> None:
    """Migrates the database at `url` down to `revision` ("base" removes every table)."""
    command.downgrade(make_config(url), revision)


def current(url: str | URL) -> str | None:
    """The revision the database at `url` is at; None for an empty (unmigrated) database."""
    engine = create_engine(normalize_url(url), poolclass=pool.NullPool)
    try:
        with engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()
    finally:
        engine.dispose()


def head() -> str:
    """The newest revision of the migration scripts (the history is linear: exactly one head)."""
    heads = ScriptDirectory.from_config(make_config()).get_heads()
    if len(heads) != 1:
        raise RuntimeError(f"migrations have {len(heads)} heads ({', '.join(heads)}); merge them into one")
    return heads[0]


def is_up_to_date(url: str | URL) -> bool:
    return current(url) == head()


def next_revision_id() -> str | None:
    """The next sequential id ("0002" after "0001"); None lets Alembic pick a random one."""
    script = ScriptDirectory.from_config(make_config())
    heads = script.get_heads()
    if not heads:
        return "0001"
    if len(heads) == 1 and _SEQUENTIAL_REV.match(heads[0]):
        return f"{int(heads[0]) + 1:04d}"
    return None


def revision(message: str, *, autogenerate: bool = False, url: str | URL | None = None) -> Path:
    """Writes a new revision file (development use) and returns its path.

    With autogenerate, the models are compared against `url`, which must be at head; without a URL a
    scratch SQLite database is upgraded to head for the comparison (SQLite batch mode renders
    `batch_alter_table` operations, which also run on PostgreSQL).
    """
    if not autogenerate:
        script = command.revision(make_config(url), message=message, rev_id=next_revision_id())
        return Path(_single_script(script).path)
    with tempfile.TemporaryDirectory(prefix="skyrl_tx_revision_") as scratch:
        compare_url = url if url is not None else f"sqlite:///{Path(scratch) / 'scratch.db'}"
        if url is None:
            upgrade(compare_url)
        elif not is_up_to_date(compare_url):
            raise RuntimeError(f"the database is at {current(compare_url)}, not head ({head()}): "
                               "run `skyrl-tx db upgrade` against it first")
        script = command.revision(make_config(compare_url), message=message, autogenerate=True,
                                  rev_id=next_revision_id())
        return Path(_single_script(script).path)


def _single_script(script: Script | list[Script | None] | None) -> Script:
    if isinstance(script, list):
        if len(script) != 1:
            raise RuntimeError(f"expected one revision script, got {len(script)}")
        script = script[0]
    if script is None:
        raise RuntimeError("alembic wrote no revision script")
    return script
