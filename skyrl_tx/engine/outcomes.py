"""How the engine names a request in its log and turns an exception into the error stored on its future."""

from __future__ import annotations

from typing import Any

from skyrl_tx.db.future_queries import FutureRow
from skyrl_tx.errors import SkyrlTxError


def named(f: FutureRow) -> str:
    """A request in the engine's log: its future id and the X-Request-Id the API logged for it (api/request_ids.py)."""
    request_id = getattr(f, "request_id", None)
    return f"{f.id} request_id={request_id}" if request_id else f.id


def error(exc: BaseException) -> dict[str, Any]:
    """The future's stored error: a SkyrlTxError's own category, message and code; anything else a server error
    that names only the exception's type."""
    if isinstance(exc, SkyrlTxError):
        return {"category": exc.category, "message": exc.message, "code": exc.code.value}
    return {"category": "server", "message": f"internal error: {type(exc).__name__}", "code": "internal"}
