"""Exception handlers: typed errors → their HTTP status with {type, message}; never a stack trace."""

from __future__ import annotations

import asyncio
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from skyrl_tx.api.submit import record_invalid_body
from skyrl_tx.errors import InvalidArgumentError, SkyrlTxError

log = logging.getLogger("skyrl_tx.api")


def error_response(status: int, code: str, message: str) -> JSONResponse:
    # A 4xx must carry a body: the SDK treats an empty 400 as a proxy reject and retries it.
    return JSONResponse(status_code=status, content={"type": code, "message": message, "detail": message})


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(SkyrlTxError)
    async def typed_error(_: Request, exc: SkyrlTxError) -> JSONResponse:
        return error_response(exc.http_status, exc.code.value, exc.message)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for err in exc.errors():
            field = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            parts.append(f"{field or 'body'}: {err.get('msg')}")
        error = InvalidArgumentError("invalid request: " + "; ".join(parts))
        # A request of a model's sequence still consumes its seq_id (api/submit.py), so later ones never wait for it.
        await asyncio.to_thread(record_invalid_body, request, exc.body, error)
        return error_response(error.http_status, error.code.value, error.message)

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return error_response(500, "internal", "internal server error")
