"""bench_server: the real skyrl_tx server in a subprocess for the benchmark modes (free port, fresh data directory)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

from skyrl_tx.ports import free_local_port

READY_MARKER = "engine ready"  # logged once the engine has recovered and serves requests


class LiveServer(NamedTuple):
    url: str
    data_dir: Path
    pid: int
    log_path: Path


def free_port() -> int:
    return free_local_port()  # outside the ephemeral range: skyrl_tx/ports.py says why


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/api/v1/healthz", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


@contextlib.contextmanager
def bench_server(base_model: str, *, name: str, env: Mapping[str, str] | None = None, drop_env: Sequence[str] = (),
                 args: Sequence[str] = (), timeout_s: float = 180.0) -> Iterator[LiveServer]:
    """Starts `python -m skyrl_tx.api` with `args`, waits until its engine is ready, yields it, stops it. `env` adds
    to (and `drop_env` removes from) this process's environment. A failure prints the server log's tail."""
    data_dir = Path(tempfile.mkdtemp(prefix="skyrl_tx_bench_"))
    log_path, port = data_dir / "server.log", free_port()
    server_env = {k: v for k, v in os.environ.items() if k not in drop_env}
    server_env.update(env or {}, SKYRL_TX_DATA_DIR=str(data_dir), PYTHONUNBUFFERED="1")
    argv = [sys.executable, "-m", "skyrl_tx.api", "--base-model", base_model, "--host", "127.0.0.1",
            "--port", str(port), *args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=server_env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while not (READY_MARKER in log_path.read_text(errors="replace") and healthy(url)):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name}: the server did not start")
            time.sleep(0.1)
        yield LiveServer(url, data_dir, proc.pid, log_path)
    except BaseException:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-40:])
        print(f"{name}: server log tail ({' '.join(argv[3:])}):\n{tail}", file=sys.stderr)
        raise
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(data_dir, ignore_errors=True)
