"""Exception handlers: typed errors → their HTTP status with {type, message, detail}; never a stack trace."""

from __future__ import annotations

import asyncio
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from skyrl_tx.api.openai.errors import OPENAI_PREFIXES, error_body
from skyrl_tx.api.submit import record_invalid_body
from skyrl_tx.errors import InvalidArgumentError, SkyrlTxError

log = logging.getLogger("skyrl_tx.api")


def error_response(status: int, code: str, message: str) -> JSONResponse:
    # A 4xx must carry a body: the SDK treats an empty 400 as a proxy reject and retries it.
    return JSONResponse(status_code=status, content={"type": code, "message": message, "detail": message})


_FRAMEWORK_CODES = {404: "not_found", 405: "method_not_allowed", 413: "invalid_argument"}
_FRAMEWORK_MESSAGES = {  # FastAPI's own wording, made to say what to fix
    "There was an error parsing the body": "invalid request: the body is not valid JSON (send a JSON object)",
    "Not Found": "no such path on this server (the Tinker API is under /api/v1, the OpenAI one under /oai/api/v1 "
                 "and /v1; /docs lists every route)",
}


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(SkyrlTxError)
    async def typed_error(_: Request, exc: SkyrlTxError) -> JSONResponse:
        return error_response(exc.http_status, exc.code.value, exc.message)

    @app.exception_handler(HTTPException)
    async def framework_error(request: Request, exc: HTTPException) -> JSONResponse:
        """What the framework refuses before a route runs (a body that is not JSON, an unknown path or method) in
        the same shape as every other error: the OpenAI one under the OpenAI prefixes."""
        message = _FRAMEWORK_MESSAGES.get(str(exc.detail), str(exc.detail))
        if request.url.path.startswith(OPENAI_PREFIXES):
            return JSONResponse(error_body(exc.status_code, message), status_code=exc.status_code,
                                headers=exc.headers)
        response = error_response(exc.status_code, _FRAMEWORK_CODES.get(exc.status_code, "invalid_argument"), message)
        response.headers.update(exc.headers or {})
        return response

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
