"""moto_s3(): an S3-compatible server (moto's server mode) on a free 127.0.0.1 port, plus fsspec options for it."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator

import pytest
from live_server import free_port


@contextlib.contextmanager
def moto_s3() -> Iterator[str]:
    """Yields the endpoint URL. Skips without moto_server, except under CI=true (CI machines have it)."""
    exe = shutil.which("moto_server")
    if exe is None:
        if os.environ.get("CI") == "true":
            pytest.fail("moto_server is not installed; CI machines have it (pip install 'moto[server]')")
        pytest.skip("moto_server is not installed (pip install 'moto[server]')")
    port = free_port()
    process = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            try:
                urllib.request.urlopen(url, timeout=1)
                break
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        process.wait(10)


def s3_options(endpoint: str) -> dict[str, object]:
    # Not us-east-1: s3fs always sends a LocationConstraint, which S3 (and moto) reject for us-east-1.
    return {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": endpoint, "region_name": "eu-west-1"}}


def make_bucket(endpoint: str, bucket: str) -> None:
    import s3fs

    s3fs.S3FileSystem(**s3_options(endpoint)).mkdir(bucket)
