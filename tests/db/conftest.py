"""`database_url`: every db test runs on SQLite (a file in tmp_path) and on PostgreSQL.

PostgreSQL comes from $SKYRL_TX_TEST_POSTGRES_URL (e.g. postgresql+psycopg://skyrl:skyrl@127.0.0.1:5432/skyrl_test).
Without it the PostgreSQL cases skip — except under CI=true, where they fail: CI must cover both backends.
Each PostgreSQL test gets a fresh, uniquely named schema (the URL pins search_path to it), dropped afterwards,
so tests never see each other's tables and the role only needs CREATE on the test database.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from postgres import postgres_url_or_skip, schema_url


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A URL of an empty database on each backend (nothing migrated yet)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'skyrl_tx.db'}"
    else:
        with schema_url(postgres_url_or_skip()) as url:
            yield url
