"""The console's sign-in: the key kept in an HttpOnly, SameSite=Strict cookie, handed to the API-key check as the
X-API-Key header (so /console obeys exactly the API's rules); the open pages (sign-in, sign-out, static files); CSRF.

Why a cookie and server-rendered pages, not a static app holding the key in sessionStorage: a key in sessionStorage
is readable by any script on the page (one injection away from leaking a key that works on the whole API), and a
static app would need a JSON twin of every page. An HttpOnly cookie is out of scripts' reach; SameSite=Strict keeps
other sites' pages from sending it at all; and every write also carries a CSRF token (an HMAC of the key under the
server's signing secret) and must come from this origin, which also protects --auth none servers (no cookie there).
The cookie holds the key itself (no server-side session table): it ends with the browser session or at sign-out."""

from __future__ import annotations

import hashlib
import hmac
import re
from pathlib import Path
from urllib.parse import parse_qs, quote, urlsplit

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Mount, Route, Router
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from skyrl_tx.api.auth import KeyRing, presented_key
from skyrl_tx.api.console.render import render

COOKIE = "skyrl_tx_console_key"
PREFIX = "/console"
HOME = "/console/sessions"
SIGN_IN = "/console/sign-in"
SIGN_OUT = "/console/sign-out"
STATIC = "/console/static"
OPEN = (SIGN_IN, SIGN_OUT)  # served without a key: the gate answers them itself
# The one API route the console's pages call from the browser (the session page's trace download): the cookie's key
# is handed to it too, for GET only.
TRACE_EXPORT = re.compile(r"^/api/v1/sessions/[^/]+/trace_export$")
MAX_FORM_BYTES = 16 * 1024  # a sign-in form: a key and a path
STATIC_DIR = Path(__file__).parent / "static"


def csrf_token(secret: bytes, key: str | None) -> str:
    """The token every console form carries: bound to the signed-in key (or to the server under --auth none), so a
    page of another site can neither read nor make it."""
    return hmac.new(secret, b"skyrl_tx console csrf\0" + (key or "").encode(), hashlib.sha256).hexdigest()


def same_origin(request: Request) -> bool:
    """A browser names the page that sent a POST (Origin, Sec-Fetch-Site); anything naming another site is refused.
    This server's own origin is the Host it was asked at, or its --public-url (a proxy may rewrite Host). Clients
    that send neither header (curl, tests) still need the CSRF token."""
    headers = request.headers
    if headers.get("sec-fetch-site", "same-origin") not in ("same-origin", "none"):
        return False
    origin = headers.get("origin")
    public = urlsplit(request.app.state.settings.public_base_url()).netloc
    return origin is None or urlsplit(origin).netloc in (headers.get("host", ""), public)


def cookie_key(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"cookie":
            for part in value.decode("latin-1").split(";"):
                cookie, _, content = part.strip().partition("=")
                if cookie == COOKIE and content:
                    return content
    return None


def _with_key(scope: Scope, key: str) -> Scope:
    return {**scope, "headers": [*scope["headers"], (b"x-api-key", key.encode("latin-1"))]}


def console_path(path: str | None) -> str:
    """Only a console path (else the sessions page): a link or form can never send the browser elsewhere."""
    if path and path.startswith(PREFIX + "/") and not path.startswith("//") and "\\" not in path:
        return path
    return HOME


def _secure(request: Request) -> bool:
    return request.url.scheme == "https" or request.app.state.settings.public_base_url().startswith("https://")


# Why a signed-in browser was sent back to sign in: a code in the URL, never free text (a crafted link could
# otherwise put any words in the page's error box).
REASONS = {"revoked": "your API key was revoked; sign in with another one",
           "unknown": "this server no longer knows your API key; sign in with a current one"}


def sign_in_redirect(path: str, refused: str | None = None) -> RedirectResponse:
    """To the sign-in page, back to `path` after; `refused`: why the cookie's key stopped working (it is forgotten)."""
    reason = None if refused is None else "revoked" if " was revoked" in refused else "unknown"
    response = RedirectResponse(f"{SIGN_IN}?next={quote(path)}" + (f"&reason={reason}" if reason else ""),
                                status_code=303)
    if reason:
        response.delete_cookie(COOKIE, path="/")
    return response


class ConsoleGate:
    """ASGI middleware just outside the API-key check (api/auth.py). Under /console: answers the open pages itself,
    sends a browser without a key to the sign-in page (or back to it when its key stopped working), and otherwise
    hands the cookie's key on as X-API-Key; ApiKeyAuth then checks it as it checks every request."""

    def __init__(self, app: ASGIApp, keyring: KeyRing | None, open_pages: ASGIApp) -> None:
        self.app = app
        self.keyring = keyring  # None: --auth none (every caller is the local owner: no sign-in)
        self.open_pages = open_pages

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        if path in OPEN or path.startswith(STATIC + "/"):
            await self.open_pages(scope, receive, send)
            return
        console = path == PREFIX or path.startswith(PREFIX + "/")
        if self.keyring is None or not (console or (TRACE_EXPORT.match(path) and scope["method"] == "GET")):
            await self.app(scope, receive, send)
            return
        key = cookie_key(scope)
        if presented_key(scope) is not None or key is None:  # a client's own header (checked as it is); no cookie
            if key is None and console and presented_key(scope) is None:
                await sign_in_redirect(path)(scope, receive, send)  # a browser not signed in
            else:
                await self.app(scope, receive, send)
            return
        outcome = await self.keyring.resolve(key)  # the key check's own rules, to send a refused browser to sign in
        if isinstance(outcome, str) and console:
            await sign_in_redirect(path, outcome)(scope, receive, send)
            return
        await self.app(_with_key(scope, key), receive, send)


async def form_of(request: Request) -> dict[str, str]:
    body = bytearray()
    async for chunk in request.stream():  # read no more than a form can be: this page is open to anyone
        body.extend(chunk)
        if len(body) > MAX_FORM_BYTES:
            return {}
    return {k: v[0] for k, v in parse_qs(bytes(body).decode("utf-8", "replace")).items()}


def open_pages(keyring: KeyRing | None) -> Router:
    """Sign-in (GET: the form; POST: check the key, set the cookie), sign-out, and the static CSS / JS."""

    async def sign_in(request: Request) -> Response:
        if keyring is None:
            return RedirectResponse(HOME, status_code=303)
        if request.method == "GET":
            return render(request, "sign_in.html", next=console_path(request.query_params.get("next")),
                          error=REASONS.get(request.query_params.get("reason", "")), who=None)
        if not same_origin(request):
            return render(request, "error.html", status=403, who=None, title="Refused",
                          message="sign-in: the form was sent from another site")
        form = await form_of(request)
        key, target = form.get("api_key", "").strip(), console_path(form.get("next"))
        outcome = await keyring.resolve(key) if key else "sign-in: enter an API key (tml-...)"
        if isinstance(outcome, str):
            return render(request, "sign_in.html", status=401, next=target, error=outcome, who=None)
        response = RedirectResponse(target, status_code=303)
        response.set_cookie(COOKIE, key, path="/", httponly=True, samesite="strict", secure=_secure(request))
        return response

    async def sign_out(request: Request) -> Response:
        if not same_origin(request):
            return render(request, "error.html", status=403, who=None, title="Refused",
                          message="sign-out: the form was sent from another site")
        response = RedirectResponse(SIGN_IN, status_code=303)
        response.delete_cookie(COOKIE, path="/")
        return response

    return Router(routes=[Route(SIGN_IN, sign_in, methods=["GET", "POST"]),
                          Route(SIGN_OUT, sign_out, methods=["POST"]),
                          Mount(STATIC, app=StaticFiles(directory=STATIC_DIR), name="static")])

