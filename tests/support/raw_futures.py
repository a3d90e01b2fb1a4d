"""A future's answer over raw HTTP (for tests that send what the SDK cannot): long-polls retrieve_future."""

from __future__ import annotations

import time
from typing import Any

TIMEOUT_S = 120


def retrieve(http: Any, request_id: str, timeout_s: float = TIMEOUT_S) -> dict[str, Any]:
    """The future's answer once it is done (each call is one long poll, woken when it finishes)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = http.post("/api/v1/retrieve_future", json={"request_id": request_id})
        assert r.status_code == 200, r.text
        if r.json().get("type") != "try_again":
            return r.json()
    raise AssertionError(f"{request_id} did not finish in {timeout_s} s (an engine waiting on a seq_id gap?)")
