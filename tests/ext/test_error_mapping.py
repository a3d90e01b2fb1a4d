"""C++ typed errors (and c10 errors) reach Python as the skyrl_tx.errors classes with clean messages."""

from __future__ import annotations

import pytest

from skyrl_tx import errors
from skyrl_tx._ext import load_extension

CASES = [
    ("InvalidArgument", errors.InvalidArgumentError, 400, "user"),
    ("NotFound", errors.NotFoundError, 404, "user"),
    ("Conflict", errors.ConflictError, 409, "user"),
    ("ResourceExhausted", errors.ResourceExhaustedError, 503, "server"),
    ("Unimplemented", errors.UnimplementedError, 501, "user"),
    ("Internal", errors.InternalError, 500, "server"),
    ("c10", errors.InternalError, 500, "server"),
    ("c10_value", errors.InvalidArgumentError, 400, "user"),
]


@pytest.mark.parametrize(("kind", "cls", "status", "category"), CASES)
def test_cpp_error_kind_maps_to_python_class(kind: str, cls: type, status: int, category: str) -> None:
    with pytest.raises(cls) as info:
        load_extension()._raise_for_test(kind, "forward: something specific (got 3, expected 4)")
    assert isinstance(info.value, errors.SkyrlTxError)
    assert "forward: something specific (got 3, expected 4)" in info.value.message
    # No C++ backtrace or file:line leaks into the user-facing message.
    assert "Exception raised from" not in info.value.message and ".cpp" not in info.value.message
    assert (info.value.http_status, info.value.category) == (status, category)
