"""FiniteJSONResponse: JSON that never fails on NaN or infinity (results a diverged model produced)."""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse

from skyrl_tx.finite_json import finite_json


class FiniteJSONResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except ValueError:  # allow_nan=False met a NaN or infinity: rare, so only then walk the content
            return json.dumps(finite_json(content), ensure_ascii=False, allow_nan=False, indent=None,
                              separators=(",", ":")).encode("utf-8")
