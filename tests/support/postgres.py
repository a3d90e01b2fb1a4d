"""PostgreSQL for tests: the server URL from the environment (skip locally, fail in CI) and throwaway schemas.

PostgreSQL comes from $SKYRL_TX_TEST_POSTGRES_URL (e.g. postgresql+psycopg://skyrl:skyrl@127.0.0.1:5432/skyrl_test;
.ci/run starts the server and exports it). Each user gets a fresh, uniquely named schema that the URL pins
search_path to, dropped afterwards, so tests never see each other's tables and the role only needs CREATE.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator

import pytest

POSTGRES_URL_ENV = "SKYRL_TX_TEST_POSTGRES_URL"


def postgres_url_or_skip() -> str:
    """The server URL; without one the test skips, except under CI=true, where it fails: CI covers both."""
    url = os.environ.get(POSTGRES_URL_ENV)
    if url:
        return url
    message = (f"{POSTGRES_URL_ENV} is not set: the PostgreSQL cases need a server, e.g. "
               "postgresql+psycopg://skyrl:skyrl@127.0.0.1:5432/skyrl_test")
    if os.environ.get("CI") == "true":
        pytest.fail(f"{message}. In CI, .ci/run must start PostgreSQL (pg_ctlcluster 15 main start), create the "
                    f"role and database, and export {POSTGRES_URL_ENV}.", pytrace=False)
    pytest.skip(message)


@contextlib.contextmanager
def schema_url(base_url: str, prefix: str = "skyrl_test") -> Iterator[str]:
    """A URL whose search_path is a fresh empty schema; the schema is dropped afterwards."""
    import sqlalchemy as sa
    from sqlalchemy.engine import make_url

    schema = f"{prefix}_{uuid.uuid4().hex[:16]}"
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
