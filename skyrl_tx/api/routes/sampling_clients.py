"""join_sampling_session: a number, unique within its sampling session, for each further client of that session."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict
from sqlalchemy import update

from skyrl_tx.api.deps import DbDep
from skyrl_tx.api.ownership import SAMPLERS, owned_sampler
from skyrl_tx.api.principal import CallerDep
from skyrl_tx.api.responses import BODY_ERRORS, JoinSamplingSessionResponse, errors
from skyrl_tx.errors import InvalidArgumentError

router = APIRouter(prefix="/api/v1")

# A sampling client numbers its sample requests client_counter * 1e9 + n (n from 0), so each client's requests have
# their own future ids. The original client is 0. An unpickled copy (or one made from a sampler handle) asks for its
# number here when the client config says sample_join_sampling_session; without that flag, or from an SDK that
# pickled it with the flag off, a copy draws a random number in 1..1e9 itself. Numbers handed out start above that
# range, so the two kinds of copies of one sampling session can never share a number.
FIRST_JOINED = 1_000_000_001
SEQ_IDS_PER_CLIENT = 1_000_000_000
LAST_JOINED = (2**63 - 1) // SEQ_IDS_PER_CLIENT - 1  # its seq ids still fit the signed 64-bit seq_id


class JoinSamplingSessionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    sampling_session_id: str


@router.post("/join_sampling_session", responses={**BODY_ERRORS, **errors(404)})
def join_sampling_session(body: JoinSamplingSessionRequest, db: DbDep,
                          who: CallerDep) -> JoinSamplingSessionResponse:
    """The next number of this sampling session. A retried join (its answer lost) takes another number: numbers
    are never reused, gaps are harmless."""
    owned_sampler(db, body.sampling_session_id, who, f"join_sampling_session: sampling session "
                  f"{body.sampling_session_id!r} not found; create a sampling client first")
    # One statement: concurrent joins (any number of API workers or replicas) each get their own count.
    joined = db.execute(update(SAMPLERS).where(SAMPLERS.c.id == body.sampling_session_id)
                        .values(clients_joined=SAMPLERS.c.clients_joined + 1)
                        .returning(SAMPLERS.c.clients_joined)).scalar_one()
    counter = FIRST_JOINED + joined - 1
    if counter > LAST_JOINED:
        raise InvalidArgumentError(f"join_sampling_session: sampling session {body.sampling_session_id!r} has "
                                   "numbered all the clients it can; create a new sampling client")
    db.commit()
    return JoinSamplingSessionResponse(type="join_sampling_session", client_counter=counter)
