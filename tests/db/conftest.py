"""`database_url`: every db test runs on SQLite (a file in tmp_path) and on PostgreSQL.

PostgreSQL comes from $SKYRL_TX_TEST_POSTGRES_URL (e.g. postgresql+psycopg://skyrl:skyrl@127.0.0.1:5432/skyrl_test).
Without it the PostgreSQL cases skip — except under CI=true, where they fail: CI must cover both backends.
Each PostgreSQL test gets a fresh, uniquely named schema (the URL pins search_path to it), dropped afterwards,
so tests never see each other's tables and the role only needs CREATE on the test database.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

POSTGRES_URL_ENV = "SKYRL_TX_TEST_POSTGRES_URL"


def _postgres_base_url() -> str:
    url = os.environ.get(POSTGRES_URL_ENV)
    if url:
        return url
    message = (f"{POSTGRES_URL_ENV} is not set: the PostgreSQL cases need a server, e.g. "
               "postgresql+psycopg://skyrl:skyrl@127.0.0.1:5432/skyrl_test")
    if os.environ.get("CI") == "true":
        pytest.fail(f"{message}. In CI, .ci/run must start PostgreSQL (pg_ctlcluster 15 main start), create the "
                    f"role and database, and export {POSTGRES_URL_ENV}.", pytrace=False)
    pytest.skip(message)


def _postgres_schema_url(base_url: str) -> Iterator[str]:
    schema = f"skyrl_test_{uuid.uuid4().hex[:16]}"
    admin = sa.create_engine(base_url, poolclass=sa.pool.NullPool, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as connection:
            connection.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
        url = make_url(base_url).update_query_dict({"options": f"-csearch_path={schema}"})
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.connect() as connection:
            connection.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        admin.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A URL of an empty database on each backend (nothing migrated yet)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'skyrl_tx.db'}"
    else:
        yield from _postgres_schema_url(_postgres_base_url())
