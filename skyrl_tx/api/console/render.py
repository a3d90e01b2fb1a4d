"""The console's HTML: the Jinja2 environment (autoescaped templates shipped in the package), page responses with
their security headers, and ConsoleRoute, which shows a route's typed error as an HTML page with the API's status."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from datetime import datetime
from pathlib import Path
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from jinja2 import Environment, FileSystemLoader, select_autoescape

from skyrl_tx.errors import SkyrlTxError

TEMPLATES = Path(__file__).parent / "templates"
# Scripts, styles and fetches from this server only (nothing from the internet, nothing inline runs); no framing.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
ENV = Environment(loader=FileSystemLoader(TEMPLATES), autoescape=select_autoescape(["html"]), trim_blocks=True,
                  lstrip_blocks=True)


def _when(value: datetime | str | None) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    return value.strftime("%Y-%m-%d %H:%M:%S UTC")


def _size(n: int | None) -> str:
    if n is None:
        return ""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(n)


ENV.filters["when"] = _when
ENV.filters["size"] = _size


def render(request: Request, template: str, status: int = 200, **context: Any) -> Response:
    """A page: no caching (it shows one key's objects), a strict Content-Security-Policy (scripts and styles from
    this server only: nothing is fetched from the internet, nothing inline runs), no framing."""
    html = ENV.get_template(template).render(request=request, **context)
    return Response(html, status_code=status, media_type="text/html; charset=utf-8", headers={
        "Content-Security-Policy": CSP, "Cache-Control": "no-store", "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "same-origin"})


class ConsoleRoute(APIRoute):
    """A console route: a typed error (not found, not an admin, bad input) becomes an HTML page with the status the
    API would answer, instead of the API's JSON body."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            try:
                return await handler(request)
            except SkyrlTxError as exc:
                return render(request, "error.html", status=exc.http_status, who=None, title="Error",
                              message=exc.message)

        return handle
