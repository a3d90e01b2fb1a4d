"""`skyrl-tx keys create/list/revoke`: the key is printed once and stored only as its sha256, on the server's
database (the same --database-url / $SKYRL_TX_DATA_DIR defaults); mistakes are one clear line, exit 2."""

from __future__ import annotations

import hashlib
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def keys(data_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SKYRL_TX_DATA_DIR": str(data_dir)}
    env.pop("SKYRL_TX_DATABASE_URL", None)
    return subprocess.run([sys.executable, "-m", "skyrl_tx.cli", "keys", *args], capture_output=True, text=True,
                          env=env, timeout=120, cwd=REPO)


def test_create_prints_the_key_once_and_stores_only_its_hash(tmp_path: Path) -> None:
    made = keys(tmp_path, "create", "--name", "alice", "--max-live-models", "2", "--max-inflight-requests", "8")
    assert made.returncode == 0, made.stderr
    key = made.stdout.strip()
    assert key.startswith("tml-") and len(key) > 40 and "\n" not in key
    assert "shown only this once" in made.stderr and key not in made.stderr
    database = tmp_path / "skyrl_tx.db"  # the server's default database in its data directory
    assert key.encode() not in database.read_bytes()
    with sqlite3.connect(database) as db:
        rows = db.execute("SELECT name, key_hash, admin, max_live_models, max_inflight_requests, revoked_at "
                          "FROM api_keys").fetchall()
    assert rows == [("alice", hashlib.sha256(key.encode()).hexdigest(), 0, 2, 8, None)]
    second = keys(tmp_path, "create", "--name", "root", "--admin").stdout.strip()
    assert second.startswith("tml-") and second != key

    listed = keys(tmp_path, "list")
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines[0].split()[:4] == ["ID", "NAME", "PREFIX", "ADMIN"] and len(lines) == 3
    assert "alice" in lines[1] and key[:10] + "..." in lines[1] and key not in listed.stdout
    assert " yes " in lines[2] and second not in listed.stdout


def test_revoke_by_name_or_id_and_mistakes_are_clear(tmp_path: Path) -> None:
    keys(tmp_path, "create", "--name", "alice")
    keys(tmp_path, "create", "--name", "bob")
    revoked = keys(tmp_path, "revoke", "alice")
    assert revoked.returncode == 0 and "revoked API key 'alice'" in revoked.stderr
    bob_id = next(line.split()[0] for line in keys(tmp_path, "list").stdout.splitlines() if " bob " in line)
    assert keys(tmp_path, "revoke", bob_id).returncode == 0
    with sqlite3.connect(tmp_path / "skyrl_tx.db") as db:
        assert db.execute("SELECT count(*) FROM api_keys WHERE revoked_at IS NOT NULL").fetchone() == (2,)

    unknown = keys(tmp_path, "revoke", "carol")
    assert unknown.returncode == 2 and "no key named 'carol'" in unknown.stderr and "keys list" in unknown.stderr
    duplicate = keys(tmp_path, "create", "--name", "alice")
    assert duplicate.returncode == 2 and "a key named 'alice' exists already" in duplicate.stderr
    assert duplicate.stdout == ""
    bad_quota = keys(tmp_path, "create", "--name", "dave", "--max-live-models", "0")
    assert bad_quota.returncode == 2 and "--max-live-models must be >= 1" in bad_quota.stderr


def test_an_explicit_database_url_is_used(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'elsewhere.db'}"
    assert keys(tmp_path / "data", "create", "--name", "alice", "--database-url", url).returncode == 0
    assert "alice" in keys(tmp_path / "data", "list", "--database-url", url).stdout
    assert "alice" not in keys(tmp_path / "data", "list").stdout
