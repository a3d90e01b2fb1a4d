"""The skyrl_tx error hierarchy; the C++ bindings raise these classes, the API maps them to HTTP."""

from __future__ import annotations

from enum import Enum


class ErrorCode(str, Enum):
    INVALID_ARGUMENT = "invalid_argument"
    NOT_FOUND = "not_found"
    CONFLICT = "conflict"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    GONE = "gone"
    UNIMPLEMENTED = "unimplemented"
    INTERNAL = "internal"


class SkyrlTxError(Exception):
    """Base class. `code` picks the HTTP status; `category` is what Tinker futures report."""

    code = ErrorCode.INTERNAL
    http_status = 500
    category = "server"

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else self.__class__.__name__


class InvalidArgumentError(SkyrlTxError, ValueError):
    code, http_status, category = ErrorCode.INVALID_ARGUMENT, 400, "user"


class NotFoundError(SkyrlTxError, LookupError):
    code, http_status, category = ErrorCode.NOT_FOUND, 404, "user"


class ConflictError(SkyrlTxError):
    code, http_status, category = ErrorCode.CONFLICT, 409, "user"


class GoneError(SkyrlTxError):
    """The object existed and has ended for good (a finished or expired session): the SDK stops on a 410."""

    code, http_status, category = ErrorCode.GONE, 410, "user"


class ResourceExhaustedError(SkyrlTxError):
    code, http_status, category = ErrorCode.RESOURCE_EXHAUSTED, 503, "server"


class UnimplementedError(SkyrlTxError, NotImplementedError):
    code, http_status, category = ErrorCode.UNIMPLEMENTED, 501, "user"


class InternalError(SkyrlTxError, RuntimeError):
    code, http_status, category = ErrorCode.INTERNAL, 500, "server"
