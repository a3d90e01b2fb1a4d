"""Migrations are the schema: upgrade/downgrade round trip, no drift from the models, the CLI, the wheel mapping."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from skyrl_tx.db import migrate
from skyrl_tx.db.models import Base

REPO = Path(__file__).resolve().parents[2]
TABLES = {"sessions", "models", "futures", "checkpoints", "sampling_sessions", "recovery_snapshots",
          "api_keys", "stability_uses", "audit_events"}


def table_names(url: str) -> set[str]:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        return set(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_models_define_exactly_the_expected_tables() -> None:
    assert set(Base.metadata.tables) == TABLES


def test_upgrade_creates_every_table(database_url: str) -> None:
    assert migrate.current(database_url) is None
    migrate.upgrade(database_url)
    assert table_names(database_url) == TABLES | {"alembic_version"}
    assert migrate.current(database_url) == migrate.head()
    assert migrate.is_up_to_date(database_url)


def test_downgrade_to_base_then_upgrade_again(database_url: str) -> None:
    migrate.upgrade(database_url)
    migrate.downgrade(database_url, "base")
    assert table_names(database_url) <= {"alembic_version"}
    assert migrate.current(database_url) is None
    migrate.upgrade(database_url)
    assert table_names(database_url) == TABLES | {"alembic_version"}
    assert migrate.current(database_url) == migrate.head()


def test_autogenerate_finds_no_difference_between_models_and_migrations(database_url: str) -> None:
    migrate.upgrade(database_url)
    engine = sa.create_engine(database_url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(connection, opts={"compare_type": True})
            diff = compare_metadata(context, Base.metadata)
    finally:
        engine.dispose()
    assert diff == [], f"models and migrations differ; add a revision (skyrl-tx db revision --autogenerate): {diff}"


def skyrl_tx_cli(*args: str) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).with_name("skyrl-tx")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "skyrl_tx.cli"]
    env = {k: v for k, v in os.environ.items() if k != "SKYRL_TX_DATABASE_URL"}
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=300, env=env, cwd=REPO)


def test_cli_db_upgrade_and_current(database_url: str) -> None:
    result = skyrl_tx_cli("db", "upgrade", "--database-url", database_url)
    assert result.returncode == 0, result.stderr
    assert migrate.current(database_url) == migrate.head()
    assert table_names(database_url) == TABLES | {"alembic_version"}
    plain = database_url.replace("postgresql+psycopg://", "postgresql://")  # the driver is filled in
    result = skyrl_tx_cli("db", "current", "--database-url", plain)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{migrate.head()} (head)"


def test_cli_db_downgrade_unknown_revision_is_a_clear_error(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'x.db'}"
    result = skyrl_tx_cli("db", "downgrade", "9999", "--database-url", url)
    assert result.returncode == 2
    assert "Can't locate revision identified by '9999'" in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_db_upgrade_defaults_to_sqlite_in_the_data_dir(tmp_path: Path) -> None:
    data_dir = tmp_path / "data" / "nested"
    script = Path(sys.executable).with_name("skyrl-tx")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "skyrl_tx.cli"]
    env = {k: v for k, v in os.environ.items() if k != "SKYRL_TX_DATABASE_URL"} | {"SKYRL_TX_DATA_DIR": str(data_dir)}
    result = subprocess.run([*command, "db", "upgrade"], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    assert migrate.current(f"sqlite:///{data_dir / 'skyrl_tx.db'}") == migrate.head()


def test_history_is_linear_with_dated_sequential_files() -> None:
    script = ScriptDirectory.from_config(migrate.make_config())
    assert script.get_heads() == [migrate.head()]
    revisions = list(script.walk_revisions())
    assert [r.revision for r in reversed(revisions)] == [f"{i:04d}" for i in range(1, len(revisions) + 1)]
    for rev in revisions:
        name = Path(rev.path).name
        assert re.fullmatch(rf"\d{{4}}_\d{{2}}_\d{{2}}_{rev.revision}_\w+\.py", name), name
        text = Path(rev.path).read_text()
        assert "skyrl_tx" not in text, f"{name}: revisions must not import the application"


def test_migrations_dir_has_env_and_versions() -> None:
    directory = migrate.migrations_dir()
    assert (directory / "env.py").is_file()
    assert (directory / "script.py.mako").is_file()
    assert any((directory / "versions").glob("*_0001_*.py"))


def test_wheel_maps_migrations_into_the_package() -> None:
    """Pitfall 12: the top-level migrations/ must ship inside the wheel as skyrl_tx/migrations."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    packages = config["tool"]["scikit-build"]["wheel"]["packages"]
    assert packages.get("skyrl_tx/migrations") == "migrations"
    assert packages.get("skyrl_tx") == "skyrl_tx"


def test_runtime_code_never_calls_create_all() -> None:
    """The schema comes only from migrations (architecture 2.6)."""
    package = REPO / "skyrl_tx"
    offenders = [str(p.relative_to(REPO)) for p in package.rglob("*.py") if "create_all(" in p.read_text()]
    assert offenders == []
