"""OpenAI-shaped errors of the OpenAI-compatible endpoint: {"error": {message, type, param, code}} with its status."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from skyrl_tx.errors import ErrorCode, SkyrlTxError

# Where the OpenAI-compatible routes live (routes/openai_compat.py): every refusal there is OpenAI-shaped.
PREFIXES = ("/oai/api/v1", "/v1")
OPENAI_PREFIXES = tuple(f"{prefix}/" for prefix in PREFIXES)

# OpenAI's error `type` per HTTP status (the openai client maps the status to its exception class).
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "invalid_request_error", 409: "invalid_request_error", 410: "invalid_request_error",
          422: "invalid_request_error", 429: "rate_limit_error", 501: "invalid_request_error"}


class OpenAIError(Exception):
    """A request the endpoint refuses: `param` names the offending field (None when no single field is at fault)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.retry_after_s = status, message, param, retry_after_s
        self.code = code or ("model_not_found" if status == 404 and param == "model" else None)


def invalid(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param, code)


def unsupported(param: str, why: str = "") -> OpenAIError:
    return OpenAIError(400, f"{param!r} is not supported by this server{': ' + why if why else ''}; leave it unset",
                       param, "unsupported_parameter")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_json(exc: OpenAIError) -> JSONResponse:
    headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s is not None else None
    return JSONResponse(error_body(exc.status, exc.message, exc.param, exc.code), status_code=exc.status,
                        headers=headers)


def from_skyrl(exc: SkyrlTxError, param: str | None = None) -> OpenAIError:
    """A typed skyrl_tx error (raised in the API or stored by the engine) as the OpenAI shape, same status."""
    return OpenAIError(exc.http_status, exc.message, param, exc.code.value, getattr(exc, "retry_after_s", None))


def from_future_error(error: dict[str, Any] | None) -> OpenAIError:
    """A sampling future the engine failed: a user error keeps its 4xx, anything else is a 500."""
    error = error or {}
    message, code = error.get("message", "sampling failed"), error.get("code")
    statuses = {ErrorCode.INVALID_ARGUMENT.value: 400, ErrorCode.NOT_FOUND.value: 404, ErrorCode.GONE.value: 410,
                ErrorCode.CONFLICT.value: 409, ErrorCode.RESOURCE_EXHAUSTED.value: 503}
    status = statuses.get(code, 400 if error.get("category") == "user" else 500)
    return OpenAIError(status, message, None, code)
