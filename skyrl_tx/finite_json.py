"""finite_json / dumps_finite: JSON that never fails on NaN or infinity (values a diverged model produces)."""

from __future__ import annotations

import json
import math
from typing import Any

# Strict JSON has no NaN or infinity: PostgreSQL's JSON type refuses the bare tokens, and the SDK parses with orjson,
# which does too. As strings, pydantic turns them back into floats for the SDK's float fields.
_NON_FINITE = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


def finite_json(value: Any) -> Any:
    """`value` with every non-finite float replaced by "NaN", "Infinity" or "-Infinity"."""
    if isinstance(value, float):
        return value if math.isfinite(value) else _NON_FINITE[repr(value)]
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value


def dumps_finite(value: Any) -> str:
    """json.dumps that never writes bare NaN/Infinity tokens: the database's JSON serializer (db/session.py).
    Rare, so only a failing value is walked."""
    try:
        return json.dumps(value, allow_nan=False)
    except ValueError:
        return json.dumps(finite_json(value), allow_nan=False)
