"""Provenance spans of forward / forward_backward datums (SDK 0.38 `Datum.with_provenance`) and the stability
records they name.

Every loss: a datum's `model_input_spans` must tile its input tokens and its `loss_fn_input_spans` its
`target_tokens` (run lengths summing to the field's length).

`stable_reinforce`: every sequence a span names must be a recorded sample (asample with `record_stability_info=True`)
of the training model's own session (recorded sequences belong to the session that sampled them, as the Tinker docs
say), finished and not expired. The span's positions must be in range and hold, token for token, what that sample's
prompt or sampled tokens hold there (the targets' prompt runs only in range: they carry no loss, and the cookbook
pads them with 0), and the datum's `logprobs` at a sampled run must be the ones the server recorded for those tokens
(within 1e-4): the sampler-side logprobs the loss reads are the server's own. The record is the sample's own future (its prompt and result). It expires a day after its last
use by a datum, or a day after its completion if no datum named it yet (STABILITY_RECORD_TTL); each accepted use
restarts that day (db StabilityUseRecord; engine/retention.py keeps the futures of unexpired records).

Each failure is an InvalidArgumentError naming the datum, the field and the sequence_id (a 400, or, where the
request consumed its seq_id, a failed future of category "user")."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import numpy as np
from sqlalchemy import Connection, select

from skyrl_tx.db.models import STABILITY_RECORD_TTL, FutureRecord, FutureStatus, ModelRecord, StabilityUseRecord
from skyrl_tx.errors import InvalidArgumentError

SPAN_FIELDS = ("model_input_spans", "loss_fn_input_spans")
# stable_reinforce: how far a datum's sampler logprob may be from the server's record of it (the SDK sends float32)
LOGPROB_TOLERANCE = 1e-4


def _field_tokens(datum: dict[str, Any], field: str) -> np.ndarray | None:
    """The tokens a span list tiles: the input tokens, or target_tokens (None when the datum has none)."""
    if field == "model_input_spans":
        return datum["input_tokens"]
    targets = datum["loss_fn_inputs"].get("target_tokens")
    return None if targets is None else targets["values"]


def _check_tiling(spans: list[dict[str, Any]], tokens: np.ndarray | None, where: str) -> None:
    total = sum(span["length"] for span in spans)
    for span in spans:
        if span["length"] < 0 or span["offset"] < 0 or not span["sequence_id"]:
            raise InvalidArgumentError(f"{where}: a span has a negative offset or length or no sequence_id; build "
                                       "spans with Datum.with_provenance")
    if tokens is not None and total != tokens.size:
        raise InvalidArgumentError(f"{where}: the spans cover {total} positions but the field has {tokens.size}; "
                                   "the runs must tile it exactly (Datum.with_provenance checks this)")


def check_provenance(db: Connection, data: list[dict[str, Any]], kind: str, loss_fn: str, model_id: str) -> None:
    """Checks the datums' spans (module docstring); for stable_reinforce also their records, then marks them used."""
    for i, datum in enumerate(data):
        for field in SPAN_FIELDS:
            if field in datum:
                _check_tiling(datum[field], _field_tokens(datum, field), f"{kind}: datum {i} {field}")
    if loss_fn != "stable_reinforce":
        return  # provenance only: nothing else reads it
    named = {span["sequence_id"].rpartition(":")[0] for datum in data for field in SPAN_FIELDS
             for span in datum.get(field, ())}
    if not named:
        return
    now = datetime.now(timezone.utc)
    # Recorded sequences belong to the session that sampled them: the training model's session, which the caller
    # owns (the route checked the model's owner), so no owner check is needed here.
    session_id = db.execute(select(ModelRecord.session_id).where(ModelRecord.id == model_id)).scalar_one()
    records = _records(db, named, session_id)
    for i, datum in enumerate(data):
        for field in SPAN_FIELDS:
            tokens, position = _field_tokens(datum, field), 0
            for span in datum.get(field, ()):
                where = f"{kind}: datum {i} {field} names sequence {span['sequence_id']!r}"
                recorded = _recorded_tokens(records, span, now, where)
                end = span["offset"] + span["length"]
                if end > len(recorded):
                    raise InvalidArgumentError(f"{where} at positions [{span['offset']}, {end}), but its "
                                               f"{span['kind']} tokens number {len(recorded)}")
                # Prompt runs of the targets are not compared: they carry no loss, and the cookbook's rl_loop pads
                # them with 0 (what it trains on are the sampled runs).
                if tokens is not None and not (field == "loss_fn_input_spans" and span["kind"] == "prompt"):
                    _check_same_tokens(tokens[position:position + span["length"]], recorded[span["offset"]:end],
                                       position, span, where)
                if field == "loss_fn_input_spans" and span["kind"] == "sampled":
                    _check_sampler_logprobs(datum, records, span, position, where)
                position += span["length"]
    _mark_used(db, named, now)


def _check_same_tokens(claimed: np.ndarray, recorded: list[int], position: int, span: dict[str, Any],
                       where: str) -> None:
    for k, (have, want) in enumerate(zip(claimed.tolist(), recorded)):
        if have != want:
            raise InvalidArgumentError(f"{where}, but the datum's token at position {position + k} is {have} where "
                                       f"the sequence's {span['kind']} token {span['offset'] + k} is {want}")


def _check_sampler_logprobs(datum: dict[str, Any], records: dict[str, dict[str, Any]], span: dict[str, Any],
                            position: int, where: str) -> None:
    """The sampler-side logprobs the loss reads (the datum's `logprobs` at a sampled run) must be what the server's
    record of that sample holds, within LOGPROB_TOLERANCE: the client cannot train on sampling numerics the server
    never produced."""
    claimed = datum["loss_fn_inputs"].get("logprobs")
    if claimed is None:
        raise InvalidArgumentError(f"{where}, but the datum has no loss_fn_inputs['logprobs']: stable_reinforce reads "
                                   "the sampler's logprobs there; copy them from the SampledSequence")
    request_id, _, index_text = span["sequence_id"].rpartition(":")
    recorded = records[request_id]["result"]["sequences"][int(index_text)].get("logprobs")
    if recorded is None:
        raise InvalidArgumentError(f"{where}, whose record holds no logprobs: sample it again with "
                                   "record_stability_info=True")
    want = np.asarray(recorded[span["offset"]:span["offset"] + span["length"]], dtype=np.float64)
    have = np.asarray(claimed["values"][position:position + span["length"]], dtype=np.float64)
    off = np.flatnonzero(~(np.abs(have - want) <= LOGPROB_TOLERANCE))
    if off.size:
        k = int(off[0])
        raise InvalidArgumentError(
            f"{where}, but the datum's logprobs at position {position + k} is {have[k]:.6g} where the server recorded "
            f"{want[k]:.6g} for the sequence's sampled token {span['offset'] + k} (tolerance {LOGPROB_TOLERANCE:g}): "
            "send the SampledSequence's own logprobs")


def _records(db: Connection, request_ids: set[str], session_id: str) -> dict[str, dict[str, Any]]:
    """The named samples of `session_id` with their last use, by id (unknown ids and other sessions' are absent)."""
    rows = db.execute(select(FutureRecord.id, FutureRecord.status, FutureRecord.request, FutureRecord.result,
                             FutureRecord.completed_at, StabilityUseRecord.last_used_at)
                      .outerjoin(StabilityUseRecord, StabilityUseRecord.request_id == FutureRecord.id)
                      .where(FutureRecord.id.in_(sorted(request_ids)), FutureRecord.session_id == session_id,
                             FutureRecord.request_type == "sample")).all()
    return {row.id: row._asdict() for row in rows}


def _recorded_tokens(records: dict[str, dict[str, Any]], span: dict[str, Any], now: datetime, where: str) -> list[int]:
    request_id, _, index_text = span["sequence_id"].rpartition(":")
    record = records.get(request_id)
    if record is None or not index_text.isdigit() or int(index_text) >= record["request"].get("num_samples", 0):
        raise InvalidArgumentError(f"{where}, which is unknown: name a SampledSequence.sequence_id sampled in this "
                                   "training model's session")
    if not record["request"].get("record_stability_info"):
        raise InvalidArgumentError(f"{where}, which was sampled without record_stability_info=True: sample with it "
                                   "for stable_reinforce")
    if record["status"] != FutureStatus.COMPLETED.value:
        raise InvalidArgumentError(f"{where}, whose sample has {record['status']} rather than completed: train on "
                                   "sequences once their sample has returned")
    last_use = record["last_used_at"] or record["completed_at"]
    if now - last_use > STABILITY_RECORD_TTL:
        raise InvalidArgumentError(f"{where}, whose stability record expired (records last a day after their last "
                                   f"use; this one was last used {last_use.isoformat()}): sample it again")
    if span["kind"] == "prompt":
        return list(record["request"]["prompt_tokens"])
    return list(record["result"]["sequences"][int(index_text)]["tokens"])


def _mark_used(db: Connection, request_ids: set[str], now: datetime) -> None:
    """last_used_at = now for each record, inserted or updated in one statement (concurrent uses cannot collide)."""
    if db.dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    statement = insert(StabilityUseRecord).values([{"request_id": r, "last_used_at": now} for r in sorted(request_ids)])
    db.execute(statement.on_conflict_do_update(index_elements=["request_id"],
                                               set_={"last_used_at": statement.excluded.last_used_at}))
