"""FiniteJSONResponse: JSON that never fails on NaN or infinity (results a diverged model produced)."""

from __future__ import annotations

import json
import math
from typing import Any

from fastapi.responses import JSONResponse

# Strict JSON has no NaN or infinity, and the SDK parses with orjson, which refuses the bare tokens; as strings,
# pydantic turns them back into floats for the SDK's float fields (OptimStepResponse.metrics and the like).
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


class FiniteJSONResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except ValueError:  # allow_nan=False met a NaN or infinity: rare, so only then walk the content
            return json.dumps(finite_json(content), ensure_ascii=False, allow_nan=False, indent=None,
                              separators=(",", ":")).encode("utf-8")
