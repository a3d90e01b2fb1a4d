"""/openapi.json describes the API as it answers: schemathesis fuzzes every operation of a live server (SQLite) from
the schema and fails on any 5xx, any status the schema does not list for the operation, and any body or media type
that does not match the schema. Bounded (few examples per operation, fixed seed, no stateful phase) so it stays
within a couple of minutes on two slow cores; /docs loads."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
from live_server import ServerUrl, live_server

pytest.importorskip("schemathesis")  # in the `test` extra

CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"
MAX_EXAMPLES = 5  # per operation and phase
RUN_TIMEOUT_S = 240  # the whole run: a hang (a request that never answers) fails here, not in CI's global timeout
REQUEST_TIMEOUT_S = 30  # any one request; long polls answer at once for the unknown ids generated here
PROBE = ("import sys; from schemathesis.cli import schemathesis; sys.argv[0] = 'schemathesis'; "
         "sys.exit(schemathesis())")


@pytest.fixture(scope="module")
def sqlite_server(preset_cache) -> Iterator[ServerUrl]:
    with live_server() as url:  # SQLite: the database backend makes no difference to the schema
        yield url


def test_docs_and_schema_load(sqlite_server: ServerUrl) -> None:
    docs = httpx.get(f"{sqlite_server}/docs", timeout=30)
    assert docs.status_code == 200 and "swagger" in docs.text.lower()
    schema = httpx.get(f"{sqlite_server}/openapi.json", timeout=30).json()
    operations = [(path, method, op) for path, item in schema["paths"].items() for method, op in item.items()]
    assert len(operations) > 40
    for path, method, op in operations:
        assert "422" not in op["responses"], (method, path)  # validation errors are 400s (api/errors.py)
        assert any(status.startswith("2") for status in op["responses"]), (method, path)
        assert any(status.startswith("4") or status.startswith("5") for status in op["responses"]), (method, path)
    # every Tinker route answers a declared model, not an untyped object
    create_model = schema["paths"]["/api/v1/create_model"]["post"]["responses"]
    assert create_model["200"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ModelFuture"}
    assert create_model["400"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorBody"}
    retrieve = schema["paths"]["/api/v1/retrieve_future"]["post"]["responses"]["200"]["content"]
    assert set(retrieve) == {"application/json", "application/x-protobuf"}


def test_schemathesis_finds_no_server_error_and_no_schema_violation(sqlite_server: ServerUrl) -> None:
    args = [sys.executable, "-c", PROBE, "run", f"{sqlite_server}/openapi.json", "--checks", CHECKS,
            "--phases", "examples,coverage,fuzzing", "--max-examples", str(MAX_EXAMPLES), "--seed", "20261126",
            "--generation-deterministic", "--workers", "1",
            "--request-timeout", str(REQUEST_TIMEOUT_S), "--header", "X-API-Key: tml-test", "--no-color",
            "--suppress-health-check", "all", "--warnings", "off"]
    started = time.monotonic()
    proc = subprocess.run(args, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)
    took = time.monotonic() - started
    output = proc.stdout[-20000:] + proc.stderr[-5000:]
    assert proc.returncode == 0, f"schemathesis found problems ({took:.0f} s):\n{output}"
    assert "No issues found" in output or "passed" in output.lower(), output
