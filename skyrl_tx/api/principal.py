"""Principal: who a request acts as (an API key, or the implicit owner of --auth none); the `caller` dependency."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from skyrl_tx.errors import InternalError


@dataclass(frozen=True)
class Principal:
    """key_id None is the one implicit owner of --auth none (objects made then have no owner); an admin sees and acts
    on every key's objects."""

    key_id: str | None
    name: str
    admin: bool = False
    max_live_models: int | None = None
    max_inflight_requests: int | None = None

    def sees(self, owner_key_id: str | None) -> bool:
        return self.admin or owner_key_id == self.key_id


LOCAL = Principal(key_id=None, name="local", admin=True)  # --auth none: every caller, owner of everything


def caller_of(request: Request) -> Principal | None:
    """The principal api/auth.py put in the request state; None on an open path under --auth keys."""
    return request.scope.get("state", {}).get("principal")


async def caller(request: Request) -> Principal:
    """FastAPI dependency (async: it runs on the event loop, no thread hop for the hot routes)."""
    principal = caller_of(request)
    if principal is None:  # a route on an open path asked for a caller: a programming error, never an open door
        raise InternalError(f"no caller resolved for {request.url.path}")
    return principal


CallerDep = Annotated[Principal, Depends(caller)]
