"""A session's requests with their phase times, read back from the futures table: the one query behind the session
trace export (api/trace/), GET /api/v1/sessions/{id}/request_timings and bench latency, and meant for any other
reader of per-request timings (e.g. per-session throughput plots).

The times (timezone-aware UTC; None where a phase did not happen): stored (created_at: the API stored the
request), ordered (ordered_at: a request held behind a missing seq_id became runnable; None: never held), claimed
(started_at: the engine took it), computed (computed_at: its forward / forward_backward / sample_step returned; None
for requests without a separate compute step), completed (completed_at: its result was stored). The engine writes
them in the UPDATEs it already does (db/future_queries.py FINISH, MARK_RUNNING): none costs a write of its own. The
API's own moments (received, woken, answered) are in memory only: api/trace/ring.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from google.protobuf.message import DecodeError
from sqlalchemy import Connection, bindparam, func, or_, select

from skyrl_tx.db.models import FutureRecord, ModelRecord
from skyrl_tx.wire import tinker_wire_pb2 as pb

F = FutureRecord.__table__
ClientKind = Literal["training", "sampling", "session"]
BODY_BATCH = 256  # request bodies read per query when counting training tokens


@dataclass(frozen=True)
class RequestTiming:
    future_id: str
    request_type: str
    client_kind: ClientKind  # whose request: a training client (model), a sampling client, or the session itself
    client_id: str  # the model id, the sampling session id, or the session id
    seq_id: int | None  # the training client's seq_id (None for samples and session requests)
    status: str
    stored: datetime
    ordered: datetime | None
    claimed: datetime | None
    computed: datetime | None
    completed: datetime | None
    prompt_tokens: int = 0  # a sample's prompt tokens (times num_samples: each sequence is prefilled)
    generated_tokens: int = 0  # a finished sample's generated tokens, all sequences


def _client(row: Any) -> tuple[ClientKind, str]:
    if row.request_type == "sample":
        return "sampling", row.id.rsplit(":", 1)[0]  # api/routes/sampling.py: "<sampling session id>:<seq_id>"
    model_id = row.model_id or (row.request or {}).get("model_id")
    return ("training", model_id) if model_id else ("session", row.session_id or "")


def _sample_sizes(row: Any) -> tuple[int, int]:
    if row.request_type != "sample":
        return 0, 0
    request = row.request or {}
    prompt = len(request.get("prompt_tokens") or ()) * int(request.get("num_samples") or 1)
    sequences = (row.result or {}).get("sequences") or () if isinstance(row.result, dict) else ()
    return prompt, sum(len(s.get("tokens") or ()) for s in sequences)


def session_request_timings(db: Connection, session_id: str, limit: int) -> tuple[list[RequestTiming], int]:
    """The session's newest `limit` requests (its training clients' and sampling clients' and its own), oldest
    first, and how many it has in all. Futures are pruned by the retention sweep (engine/retention.py): so are their
    timings."""
    models = select(ModelRecord.id).where(ModelRecord.session_id == session_id).scalar_subquery()
    where = or_(F.c.session_id == session_id, F.c.model_id.in_(models))
    total = db.execute(select(func.count()).select_from(F).where(where)).scalar() or 0
    rows = db.execute(select(F.c.id, F.c.session_id, F.c.model_id, F.c.request_type, F.c.seq_id, F.c.status,
                             F.c.request, F.c.result, F.c.created_at, F.c.ordered_at, F.c.started_at,
                             F.c.computed_at, F.c.completed_at)
                      .where(where).order_by(F.c.created_at.desc(), F.c.id.desc()).limit(limit)).all()
    out = []
    for row in reversed(rows):
        kind, client = _client(row)
        prompt, generated = _sample_sizes(row)
        out.append(RequestTiming(row.id, row.request_type, kind, client, row.seq_id, row.status, row.created_at,
                                 row.ordered_at, row.started_at, row.computed_at, row.completed_at, prompt,
                                 generated))
    return out, total


BODIES = select(F.c.id, F.c.request_body, F.c.request).where(F.c.id.in_(bindparam("ids", expanding=True)))


def input_tokens(body: bytes | None, request: dict[str, Any]) -> int:
    """Input tokens of a stored forward / forward_backward (its protobuf; rows from before migration 0003 keep their
    datums in the JSON)."""
    if body is None:
        return sum(len(d.get("input_tokens") or []) for d in request.get("data") or [])
    message = pb.ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except DecodeError:  # stored by this server, so never; counted as nothing rather than failing the report
        return 0
    return sum(len(c.encoded_text.tokens) // 4 for d in message.data for c in d.model_input)


def training_tokens(db: Connection, future_ids: Sequence[str]) -> dict[str, int]:
    """input_tokens of each of these forward / forward_backward requests (their stored bodies, read in batches)."""
    out: dict[str, int] = {}
    for i in range(0, len(future_ids), BODY_BATCH):
        for id_, body, request in db.execute(BODIES, {"ids": list(future_ids[i:i + BODY_BATCH])}):
            out[id_] = input_tokens(None if body is None else bytes(body), request or {})
    return out
