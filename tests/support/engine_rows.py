"""Rows and steps for EngineLoop tests: store a session, model, or request as the API would, and read results."""

from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import select

from skyrl_tx.db.models import FutureRecord, ModelRecord, SessionRecord, request_hash
from skyrl_tx.engine.loop import EngineLoop

DATUM = {"input_tokens": [5, 6, 7, 8], "loss_fn_inputs": {
    "target_tokens": {"dtype": "int64", "shape": [4], "values": [6, 7, 8, 9]},
    "weights": {"dtype": "float32", "shape": [4], "values": [1.0, 1.0, 1.0, 1.0]}}}


def add(loop: EngineLoop, *rows) -> None:
    with loop.sessions.begin() as db:
        db.add_all(rows)


def future(fid: str, kind: str, body: dict, model_id: str | None = None, seq_id: int | None = None) -> FutureRecord:
    return FutureRecord(id=fid, request_type=kind, request=body, request_hash=request_hash(body), model_id=model_id,
                        seq_id=seq_id)


def create(loop: EngineLoop, session: str, model_id: str, heartbeat: datetime | None = None) -> None:
    add(loop, SessionRecord(id=session, last_heartbeat_at=heartbeat or datetime.now(timezone.utc)))
    add(loop, ModelRecord(id=model_id, session_id=session, base_model="tiny-qwen3", lora_rank=4),
        future(f"{model_id}:create", "create_model", {"model_id": model_id, "lora_rank": 4, "seed": 1,
                                                      "train_attn": True, "train_mlp": True, "train_unembed": True}))
    loop.step()


def results(loop: EngineLoop) -> dict[str, FutureRecord]:
    with loop.sessions() as db:
        return {f.id: f for f in db.scalars(select(FutureRecord))}
