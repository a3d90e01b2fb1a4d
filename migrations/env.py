"""Alembic environment for skyrl_tx. Run through `skyrl_tx.db.migrate` / `skyrl-tx db ...` (no alembic.ini).

The database URL is the Config's "sqlalchemy.url" main option (set by skyrl_tx.db.migrate.make_config);
target_metadata is skyrl_tx.db.models.Base.metadata, so autogenerate compares against the models.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import context
from sqlalchemy import pool
from sqlalchemy.engine import Connection

from skyrl_tx.db.models import Base, UTCDateTime

config = context.config
target_metadata = Base.metadata


def database_url() -> str:
    url = config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("no database URL: run migrations with `skyrl-tx db upgrade --database-url URL` "
                           "or skyrl_tx.db.migrate.upgrade(url)")
    return url


def render_item(type_: str, obj: Any, autogen_context: Any) -> str | bool:
    """Render the models' custom column types as plain SQLAlchemy types: revisions never import skyrl_tx."""
    if type_ == "type" and isinstance(obj, UTCDateTime):
        return "sa.DateTime(timezone=True)"
    if type_ == "type" and isinstance(obj, sa.JSON):
        return "sa.JSON()"  # none_as_null is a Python-side flag; the column type is the same
    return False


def configure(**kwargs: Any) -> None:
    context.configure(target_metadata=target_metadata, compare_type=True, render_item=render_item, **kwargs)


def run_migrations_offline() -> None:
    """Emit SQL to stdout instead of connecting (`alembic ... --sql`)."""
    url = database_url()
    configure(url=url, literal_binds=True, dialect_opts={"paramstyle": "named"},
              render_as_batch=sa.engine.make_url(url).get_backend_name() == "sqlite")
    with context.begin_transaction():
        context.run_migrations()


def run_on_connection(connection: Connection) -> None:
    sqlite = connection.dialect.name == "sqlite"
    if sqlite:
        # Batch migrations copy and drop tables; with foreign keys enforced, dropping a referenced table
        # would fail or cascade. Turn enforcement off (outside any transaction) and check afterwards.
        connection.exec_driver_sql("PRAGMA foreign_keys=OFF")
        connection.commit()
    configure(connection=connection, render_as_batch=sqlite)
    with context.begin_transaction():
        context.run_migrations()
    if sqlite:
        violations = connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
        connection.commit()
        if violations:
            raise RuntimeError(f"migration left foreign key violations (table, rowid, parent, fk): {violations}")


def run_migrations_online() -> None:
    engine = sa.create_engine(database_url(), poolclass=pool.NullPool)
    try:
        with engine.connect() as connection:
            run_on_connection(connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
