"""Secrets stay secret: no database password, storage credential or URL signing secret on the command line of any
process (`ps` shows command lines to every user of the machine), in particular the server's and its engine child's;
and a signed download URL issued before a restart still works after it (the signing secret is kept in the data dir)."""

from __future__ import annotations

import hashlib
import hmac
import json
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import pytest
import tinker
from live_server import live_server
from postgres import postgres_url_or_skip, schema_url
from sqlalchemy.engine import make_url

from skyrl_tx.cli import STORAGE_OPTIONS_ENV, build_parser, server_settings
from skyrl_tx.errors import InvalidArgumentError

API_KEY = "tml-test"


def command_lines() -> dict[int, str]:
    """Every process's command line as `ps` shows it (/proc/PID/cmdline is readable by every user)."""
    lines = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                lines[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:  # exited meanwhile
                pass
    return lines


def parent_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # exited meanwhile
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state; comm may hold spaces


def engine_child(server_pid: int, lines: dict[int, str]) -> int:
    for pid in lines:
        if parent_of(pid) == server_pid and "skyrl_tx.engine" in lines[pid]:
            return pid
    raise AssertionError(f"no engine child process of the server {server_pid}")


def process_tree(root: int, lines: dict[int, str]) -> dict[int, str]:
    """The command lines of `root` and its descendants: where a secret that other tests share (the PostgreSQL test
    URL's password) must not be. Other servers on the machine, another pytest worker's, pass that URL by design."""
    parents = {pid: parent_of(pid) for pid in lines}
    tree = {root}
    while True:
        grown = tree | {pid for pid, parent in parents.items() if parent in tree}
        if grown == tree:
            return {pid: lines[pid] for pid in tree if pid in lines}
        tree = grown


def assert_nowhere(secrets: list[str], lines: dict[int, str]) -> None:
    leaks = [(pid, line[:200]) for pid, line in lines.items() if any(s in line for s in secrets)]
    assert not leaks, f"secrets on command lines: {leaks}"


def saved_checkpoint_urls(base_url: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Signed download URLs of a freshly saved sampler checkpoint, through the real SDK."""
    monkeypatch.setenv("TINKER_BASE_URL", base_url)
    monkeypatch.setenv("TINKER_API_KEY", API_KEY)
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    with tinker.ServiceClient() as service:
        client = service.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=1).result()
        path = client.save_weights_external("secrets").result().path
        return tinker.RestClient(base_url=base_url).get_external_weights_urls(path).result().urls


def fetch(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=60) as response:
        return response.read()


def test_storage_options_and_signing_secret_stay_off_command_lines(tmp_path: Path, preset_cache: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    storage_secret, signing_secret = f"storage-{uuid.uuid4().hex}", f"signing-{uuid.uuid4().hex}"
    secret_file = tmp_path / "signing-secret"
    secret_file.write_text(signing_secret + "\n")
    secret_file.chmod(0o600)
    env = {STORAGE_OPTIONS_ENV: json.dumps({"auto_mkdir": True, "token_marker": storage_secret})}
    with live_server(env=env, extra_args=["--url-signing-secret-file", str(secret_file)]) as url:
        lines = command_lines()
        engine = engine_child(url.process.pid, lines)
        assert "--stdio" in lines[engine]
        assert_nowhere([storage_secret, signing_secret], lines)
        urls = saved_checkpoint_urls(url, monkeypatch)
        assert_nowhere([storage_secret, signing_secret], command_lines())
        for file, signed in urls.items():  # signed with the configured secret, and they download
            parsed = urllib.parse.urlsplit(signed)
            query = dict(urllib.parse.parse_qsl(parsed.query))
            checkpoint = parsed.path.split("/")[4]  # /api/v1/checkpoint_files/<id>/<file>
            signed_fields = f"{checkpoint}/{file}/{query['expires']}/{query.get('key', '')}"  # key "": --auth none
            expected = hmac.new(signing_secret.encode(), signed_fields.encode(), hashlib.sha256).hexdigest()
            assert query["sig"] == expected
            assert fetch(signed)


def test_database_password_stays_off_command_lines(tmp_path: Path, preset_cache: Path) -> None:
    with schema_url(postgres_url_or_skip(), prefix="skyrl_secrets") as database_url:
        password = make_url(database_url).password
        assert password, "the PostgreSQL test URL carries no password"
        url_file = tmp_path / "database-url"
        url_file.write_text(database_url)
        url_file.chmod(0o600)
        with live_server(extra_args=["--database-url-file", str(url_file)]) as url:
            lines = command_lines()
            engine_child(url.process.pid, lines)
            assert_nowhere([database_url], lines)  # its schema is this test's own: no process anywhere
            assert_nowhere([f":{password}@"], process_tree(url.process.pid, lines))


def test_signed_url_issued_before_a_restart_works_after_it(tmp_path: Path, preset_cache: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    with live_server(data_dir=data_dir) as url:
        urls = saved_checkpoint_urls(url, monkeypatch)
        before = {file: fetch(signed) for file, signed in urls.items()}
    secret_path = data_dir / "url_signing_secret"
    assert secret_path.stat().st_mode & 0o777 == 0o600
    secret = secret_path.read_bytes()
    with live_server(data_dir=data_dir) as url:  # a new port: keep each URL's path and query
        moved = {file: url + signed[signed.index("/api/v1/"):] for file, signed in urls.items()}
        assert {file: fetch(signed) for file, signed in moved.items()} == before
        file, signed = next(iter(moved.items()))
        forged = signed[:-1] + ("0" if signed[-1] != "0" else "1")  # a signature the secret did not make
        with pytest.raises(urllib.error.HTTPError) as err:
            fetch(forged)
        assert err.value.code == 400
    assert secret_path.read_bytes() == secret


def test_secret_settings_come_from_files_or_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parse = build_parser().parse_args
    url_file = tmp_path / "url"
    url_file.write_text("postgresql://u:pw@db/x\n")
    monkeypatch.setenv("SKYRL_TX_URL_SIGNING_SECRET", "from-the-environment")
    settings = server_settings(parse(["serve", "--base-model", "m", "--database-url-file", str(url_file)]))
    assert (settings.database_url, settings.url_signing_secret) == ("postgresql://u:pw@db/x", "from-the-environment")
    assert "pw" not in repr(settings) and "from-the-environment" not in repr(settings)
    settings = server_settings(parse(["engine", "--base-model", "m", "--database-url", "sqlite:///a.db",
                                      "--database-url-file", str(url_file)]))
    assert settings.database_url == "sqlite:///a.db"  # the flag wins
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(InvalidArgumentError, match="--url-signing-secret-file: .* is empty"):
        server_settings(parse(["serve", "--base-model", "m", "--url-signing-secret-file", str(tmp_path / "empty")]))
