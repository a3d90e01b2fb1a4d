"""/openapi.json as the server really answers: FastAPI's schema without its 422 responses (api/errors.py turns
every request validation error into a 400 with the ErrorBody shape, which the routes document)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

DESCRIPTION = (
    "A self-hosted implementation of the Tinker training and sampling API (the tinker SDK's wire format), plus an "
    "OpenAI-compatible endpoint under /oai/api/v1 (alias /v1). Errors of the Tinker routes are "
    '{"type", "message", "detail"}; those of the OpenAI routes are OpenAI-shaped ({"error": {...}}). With '
    "--auth keys every route except /api/v1/healthz, the docs and signed checkpoint and trace downloads needs an API "
    "key (X-API-Key, or Authorization: Bearer).")
_FASTAPI_VALIDATION_SCHEMAS = ("HTTPValidationError", "ValidationError")


def _without_422(schema: dict[str, Any]) -> dict[str, Any]:
    for path_item in schema.get("paths", {}).values():
        for operation in path_item.values():
            if isinstance(operation, dict):
                operation.get("responses", {}).pop("422", None)
    components = schema.get("components", {}).get("schemas", {})
    for name in _FASTAPI_VALIDATION_SCHEMAS:
        components.pop(name, None)
    return schema


def install_openapi(app: FastAPI) -> None:
    """Replaces app.openapi (what /openapi.json and /docs serve): built once, then cached, as FastAPI's is."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _without_422(get_openapi(
                title=app.title, version=app.version, openapi_version=app.openapi_version, description=DESCRIPTION,
                routes=app.routes))
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
