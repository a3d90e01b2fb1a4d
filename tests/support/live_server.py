"""live_server(): the real server (`python -m skyrl_tx.api`) as a subprocess on a free 127.0.0.1 port.

    with live_server(base_model="tiny-qwen3", database_url=url) as base_url:
        ...  # TINKER_BASE_URL=base_url

Start-up is complete when GET /api/v1/healthz answers 200 *and* the log shows "engine ready" (the engine
thread loaded the base model). The server log goes to a file; it is printed (its tail) when start-up fails,
when the block raises, or on demand (`base_url.log_tail()`: the yielded URL is a `str` carrying the log).

Environment of the server: SKYRL_TX_DATA_DIR is a fresh temporary directory per server; SKYRL_TX_CACHE_DIR
(where tiny presets are generated) is `cache_dir`, else the caller's $SKYRL_TX_CACHE_DIR (the session-scoped
`preset_cache` fixture sets it), else $SKYRL_TX_TEST_PRESET_CACHE (tests/run_all.sh's one directory for the run),
else one temporary directory shared by every server of this process, so presets are generated once per test session.

"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from skyrl_tx.ports import free_local_port

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 10.0
READY_MARKER = "engine ready"
LOG_TAIL_LINES = 80

_shared_cache_dir: Path | None = None


class ServerUrl(str):
    """The base URL (a plain str for every use) plus the server's log file."""

    log_path: Path
    process: subprocess.Popen[bytes]

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return _tail(self.log_path, lines)


def free_port() -> int:
    return free_local_port()  # outside the ephemeral range: skyrl_tx/ports.py says why


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"<no server log: {exc}>"
    return "\n".join(text.splitlines()[-lines:])


def _default_cache_dir() -> Path:
    global _shared_cache_dir
    for name in ("SKYRL_TX_CACHE_DIR", "SKYRL_TX_TEST_PRESET_CACHE"):  # the latter: tests/conftest.py, preset_cache
        if os.environ.get(name):
            return Path(os.environ[name])
    if _shared_cache_dir is None:
        _shared_cache_dir = Path(tempfile.mkdtemp(prefix="skyrl_tx_cache_"))
    return _shared_cache_dir


def _healthy(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/api/v1/healthz", timeout=2) as response:
            return response.status == 200 and json.loads(response.read()).get("status") == "ok"
    except (OSError, urllib.error.URLError, ValueError):
        return False


def _die_with_parent() -> None:
    """Linux: the server gets SIGTERM if the test process dies without tearing it down (no orphans)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)  # uvicorn shuts down gracefully (lifespan stops the engine)
    try:
        process.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(STOP_TIMEOUT_S)


@contextlib.contextmanager
def live_server(*, base_model: str = "tiny-qwen3", database_url: str | None = None,
                backend_config: Mapping[str, Any] | str | None = None, aliases: Sequence[str] = (),
                env: Mapping[str, str] | None = None, cache_dir: str | os.PathLike[str] | None = None,
                startup_timeout_s: float = STARTUP_TIMEOUT_S, extra_args: Sequence[str] = (),
                data_dir: str | os.PathLike[str] | None = None) -> Iterator[ServerUrl]:
    """Starts the server, waits until it serves, yields its base URL (http://127.0.0.1:PORT), stops it.
    `data_dir` reuses a data directory (a restart of an earlier server: same SQLite file and checkpoints)."""
    owns_data_dir = data_dir is None  # a caller's data directory outlives this server (restarts reuse it)
    data_dir = Path(data_dir) if data_dir is not None else Path(tempfile.mkdtemp(prefix="skyrl_tx_data_"))
    port = free_port()
    log_path = data_dir / f"server-{port}.log"  # one per server: a restart on the same data_dir keeps both
    args = [sys.executable, "-m", "skyrl_tx.api", "--base-model", base_model, "--host", "127.0.0.1",
            "--port", str(port)]
    if database_url is not None:
        args += ["--database-url", database_url]
    if backend_config is not None:
        args += ["--backend-config", backend_config if isinstance(backend_config, str) else json.dumps(backend_config)]
    for alias in aliases:
        args += ["--model-alias", alias]
    args += list(extra_args)
    server_env = {**os.environ, "SKYRL_TX_DATA_DIR": str(data_dir),
                  "SKYRL_TX_CACHE_DIR": str(cache_dir if cache_dir is not None else _default_cache_dir()),
                  "PYTHONUNBUFFERED": "1", **(env or {})}

    base_url = ServerUrl(f"http://127.0.0.1:{port}")
    base_url.log_path = log_path
    failed, reported = True, False
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT, env=server_env, cwd=REPO,
                                   preexec_fn=_die_with_parent if sys.platform == "linux" else None)
    base_url.process = process
    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if process.poll() is not None:
                reported = True
                raise RuntimeError(f"the server exited with code {process.returncode} during start-up "
                                   f"({' '.join(args)}); log tail:\n{_tail(log_path)}")
            if READY_MARKER in log_path.read_text(errors="replace") and _healthy(base_url):
                break
            if time.monotonic() > deadline:
                reported = True
                raise TimeoutError(f"the server did not get ready within {startup_timeout_s:.0f} s "
                                   f"({' '.join(args)}); log tail:\n{_tail(log_path)}")
            time.sleep(0.1)
        yield base_url
        failed = False
    finally:
        _stop(process)
        if failed and not reported:
            sys.stderr.write(f"\n---- skyrl_tx server log ({base_url}), last {LOG_TAIL_LINES} lines ----\n"
                             f"{_tail(log_path)}\n---- end of server log ----\n")
        if owns_data_dir:
            shutil.rmtree(data_dir, ignore_errors=True)


