"""Who the caller is: GET / DELETE /api/v1/auth/apikey/me (`tinker auth login` / `logout`; the server-side whoami)
and POST /api/v1/auth/token (no JWTs here: a clear 400)."""

from __future__ import annotations

from fastapi import APIRouter, Response
from pydantic import BaseModel, Field

from skyrl_tx.api.deps import DbDep
from skyrl_tx.api.principal import CallerDep, Principal
from skyrl_tx.api.request_ids import REQUEST_ID
from skyrl_tx.api.responses import COMMON_ERRORS, errors
from skyrl_tx.db.models import ApiKeyRecord
from skyrl_tx.errors import ErrorCode, InvalidArgumentError, SkyrlTxError

router = APIRouter(prefix="/api/v1")
ORGANIZATION = "skyrl_tx"  # one server, one organisation: its keys
LOCAL_NOTE = ("this server runs --auth none: there are no API keys, every caller acts as the one local owner of "
              "everything")


class NotAvailableHereError(SkyrlTxError):
    """A feature of hosted Tinker this server does not have. A 400, not a 501: the SDK retries every 5xx for
    minutes, and this answer will not change on a retry."""

    code, http_status, category = ErrorCode.UNIMPLEMENTED, 400, "user"


class OrgDetails(BaseModel):
    name: str


class UserDetails(BaseModel):
    email: str = Field(description="always empty: keys here belong to no user account")


class KeyDetails(BaseModel):
    org_details: OrgDetails
    user_details: UserDetails


class SelfApiKeyResponse(BaseModel):
    """The SDK CLI's SelfApiKeyResponse (tinker/cli/auth_api.py), with the WhoamiResponse fields and the key's own."""

    key_id: int = Field(description="the key id's number (its hex part); 0 under --auth none")
    name: str
    note: str
    details: KeyDetails
    user_urn: str = Field(description="skyrl_tx:key:<key id> (skyrl_tx:key:local under --auth none)")
    org_urn: str
    email: str | None = None
    id: str = Field(description="the key's id as the server names owners (`owner`, `model_owner`, audit entries)")
    admin: bool
    max_live_models: int | None = None
    max_inflight_requests: int | None = None


def _key_number(key_id: str) -> int:
    digits = key_id.removeprefix("key-")
    try:
        return int(digits, 16)
    except ValueError:  # not made by `skyrl-tx keys create`: no number to give
        return 0


@router.get("/auth/apikey/me", responses=COMMON_ERRORS)
def whoami(who: CallerDep) -> SelfApiKeyResponse:
    """The key in X-API-Key (or Authorization: Bearer), checked: its name, id, role and quotas."""
    key_id = who.key_id or "local"
    note = LOCAL_NOTE if who.key_id is None else ("admin key: sees and acts on every key's objects" if who.admin
                                                  else "sees and acts on its own objects only")
    return SelfApiKeyResponse(
        key_id=_key_number(who.key_id) if who.key_id else 0, name=who.name, note=note,
        details=KeyDetails(org_details=OrgDetails(name=ORGANIZATION), user_details=UserDetails(email="")),
        user_urn=f"skyrl_tx:key:{key_id}", org_urn=f"skyrl_tx:organization:{ORGANIZATION}", id=key_id,
        admin=who.admin, max_live_models=who.max_live_models, max_inflight_requests=who.max_inflight_requests)


@router.delete("/auth/apikey/me", status_code=204, responses={**COMMON_ERRORS, **errors(400)})
def delete_own_key(db: DbDep, who: CallerDep) -> Response:
    """Revokes the presented key itself (`tinker auth logout`), never another: its next call gets a 401 (within a
    second: the server re-reads keys that often). Audited as key_revoke."""
    from skyrl_tx.keys import revoke

    row = db.get(ApiKeyRecord, who.key_id) if who.key_id is not None else None
    if row is None:
        raise InvalidArgumentError(f"delete API key: {LOCAL_NOTE}, so there is no key to delete")
    revoke(db, row, actor=who.key_id, request_id=REQUEST_ID.get())
    return Response(status_code=204)


def _no_jwt(who: Principal) -> NotAvailableHereError:
    return NotAvailableHereError(
        "auth/token: this server issues no JWTs (its /api/v1/client/config says pjwt_auth_enabled=false, so the SDK "
        "never asks): send the API key itself in X-API-Key on every request; GET /api/v1/auth/apikey/me tells who "
        f"the key is (here: {who.name!r})")


@router.post("/auth/token", responses={**COMMON_ERRORS, **errors(400)})
def auth_token(who: CallerDep) -> None:
    raise _no_jwt(who)
