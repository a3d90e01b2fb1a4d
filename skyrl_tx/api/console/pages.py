"""The console's pages for a signed-in key (/console): its sessions, a session (training runs, checkpoints, live
plots, trace download), its checkpoints (download, publish, delete). Each page calls the API route functions that
answer the same question over REST, with the caller's principal: what a key sees here is what it sees there."""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone
from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, RedirectResponse
from markupsafe import Markup

from skyrl_tx.api.auth import presented_key
from skyrl_tx.api.console.gate import HOME, console_path, csrf_token, form_of, same_origin
from skyrl_tx.api.console.plots import Series, line_plot
from skyrl_tx.api.console.render import ConsoleRoute, render
from skyrl_tx.api.console.session_metrics import inflight, run_steps
from skyrl_tx.api.deps import DbDep
from skyrl_tx.api.principal import CallerDep, Principal, caller
from skyrl_tx.api.routes import session_info
from skyrl_tx.api.routes.sessions import AccessibleOwner, SessionSearchCursor, SessionSearchRequest, search_sessions
from skyrl_tx.api.routes.training_runs import (delete_checkpoint, external_weights_urls, get_training_run,
                                               list_all_checkpoints, list_run_checkpoints, publish_checkpoint,
                                               unpublish_checkpoint)
from skyrl_tx.checkpoints.paths import TinkerPath
from skyrl_tx.errors import InvalidArgumentError

router = APIRouter(prefix="/console", route_class=ConsoleRoute, include_in_schema=False)
PAGE = 50  # sessions / checkpoints per page
ACTIONS = {"publish": publish_checkpoint, "unpublish": unpublish_checkpoint}


def page(request: Request, template: str, who: Principal, **context: Any) -> Response:
    """A console page with what every page shows: who is signed in, the admin links, the CSRF token of its forms."""
    token = csrf_token(request.app.state.download_secret, presented_key(request.scope))
    return render(request, template, who=who, csrf=token, keys_required=request.app.state.settings.auth == "keys",
                  **context)


@router.get("")
def console_home() -> RedirectResponse:
    return RedirectResponse(HOME, status_code=303)


@router.get("/sessions")
def sessions_page(request: Request, db: DbDep, who: CallerDep, after_created: datetime | None = None,
                  after_id: str | None = None) -> Response:
    """The sessions the key may see (its own; an admin's: every key's), newest first."""
    cursor = None
    if after_created is not None and after_id:
        if after_created.tzinfo is None:
            raise InvalidArgumentError(f"sessions: after_created must carry its UTC offset (got "
                                       f"{after_created.isoformat()}); follow the page's 'Older sessions' link")
        cursor = SessionSearchCursor(last_created_at=after_created, last_session_id=after_id)
    found = search_sessions(SessionSearchRequest(owner=AccessibleOwner(type="accessible"), limit=PAGE,
                                                 cursor=cursor), db, who)
    more = None
    if found.next_cursor is not None:
        more = (f"?after_created={quote(found.next_cursor.last_created_at.isoformat())}"
                f"&after_id={quote(found.next_cursor.last_session_id)}")
    return page(request, "sessions.html", who, sessions=found.sessions, more=more)


@router.get("/sessions/{session_id}")
def session_page(session_id: str, request: Request, db: DbDep, who: CallerDep) -> Response:
    session = session_info.get_session(session_id=session_id, db=db, who=who)
    runs = [get_training_run(run_id, db, who) for run_id in session.training_run_ids]
    checkpoints = [(c, TinkerPath.parse(c.tinker_path)) for run_id in session.training_run_ids
                   for c in list_run_checkpoints(run_id, db, who).checkpoints]
    return page(request, "session.html", who, session=session, runs=runs, checkpoints=checkpoints,
                plots=_plots(request, db, session.session_id, session.training_run_ids))


@router.get("/sessions/{session_id}/metrics")
def session_metrics(session_id: str, request: Request, db: DbDep, who: CallerDep) -> JSONResponse:
    """What the session page polls: its plots, redrawn (inline SVG), and the series they show."""
    session = session_info.get_session(session_id=session_id, db=db, who=who)
    plots = _plots(request, db, session.session_id, session.training_run_ids)
    return JSONResponse({"svg": {k: str(v) for k, v in plots["svg"].items()}, "runs": plots["runs"],
                         "inflight_now": plots["inflight_now"], "status": session.status},
                        headers={"Cache-Control": "no-store"})


def _plots(request: Request, db: DbDep, session_id: str, run_ids: list[str]) -> dict[str, Any]:
    runs = run_steps(db, run_ids, request.app.state.console_steps)
    series, now = inflight(db, session_id, datetime.now(timezone.utc))
    svg: dict[str, Markup] = {
        "loss": line_plot([Series(r.run_id, list(zip(r.steps, r.loss))) for r in runs], name="loss",
                          title="loss per forward_backward (loss:sum)", x_label="forward_backward #",
                          y_label="loss:sum"),
        "throughput": line_plot([Series(r.run_id, list(zip(r.steps, r.tokens_per_s))) for r in runs],
                                name="throughput", title="tokens/s per forward_backward (engine time)",
                                x_label="forward_backward #", y_label="tokens/s"),
        "inflight": line_plot([Series("in flight", series)], name="inflight", step=True,
                              title="requests queued or running", x_label="seconds ago", y_label="requests")}
    return {"svg": svg, "inflight_now": now,
            "runs": [{"run_id": r.run_id, "steps": r.steps, "loss": r.loss, "tokens_per_s": r.tokens_per_s}
                     for r in runs]}


@router.get("/checkpoints")
def checkpoints_page(request: Request, db: DbDep, who: CallerDep, offset: int = 0) -> Response:
    listed = list_all_checkpoints(db, who, limit=PAGE, offset=offset)
    total = listed.cursor.total_count if listed.cursor else len(listed.checkpoints)
    rows = [(c, TinkerPath.parse(c.tinker_path)) for c in listed.checkpoints]
    return page(request, "checkpoints.html", who, rows=rows, offset=offset, total=total, page_size=PAGE)


@router.get("/checkpoints/{run_id}/{kind}/{name}")
def checkpoint_files(run_id: str, kind: str, name: str, request: Request, db: DbDep, who: CallerDep) -> Response:
    """Its files' signed download URLs (an hour each), as `tinker checkpoint download` gets them."""
    urls = external_weights_urls(run_id, kind, name, request, db, who)
    return page(request, "checkpoint_files.html", who, path=TinkerPath(run_id, kind, name), urls=urls)


@router.post("/checkpoints/{run_id}/{kind}/{name}/{action}")
async def checkpoint_action(run_id: str, kind: str, name: str, action: str, request: Request) -> Response:
    """publish, unpublish or delete, from a console form: same origin and the key's CSRF token, or 403."""
    who = await caller(request)
    form = await form_of(request)
    if not same_origin(request) or form.get("csrf") != csrf_token(request.app.state.download_secret,
                                                                         presented_key(request.scope)):
        return render(request, "error.html", status=403, who=who, title="Refused",
                      message=f"{action}: the form's CSRF token is missing or wrong, or it came from another site; "
                              "reload the page and try again")
    if action not in (*ACTIONS, "delete"):
        raise InvalidArgumentError(f"checkpoint action {action!r}: expected publish, unpublish or delete")

    def work() -> None:
        with request.app.state.session_factory() as db:
            if action == "delete":
                delete_checkpoint(run_id, kind, name, request, db, who)
            else:
                ACTIONS[action](run_id, kind, name, db, who)

    await asyncio.to_thread(work)
    return RedirectResponse(console_path(form.get("back")), status_code=303)
