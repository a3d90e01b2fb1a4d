"""Rows and steps for EngineLoop tests: store a session, model, or request as the API would, and read results."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import datetime, timezone

from typing import Any

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import undefer

from skyrl_tx.db.models import FutureRecord, ModelRecord, SessionRecord, request_hash
from skyrl_tx.engine.loop import EngineLoop
from skyrl_tx.wire import codec
from skyrl_tx.wire import tinker_wire_pb2 as pb

DATUM = {"input_tokens": [5, 6, 7, 8], "loss_fn_inputs": {
    "target_tokens": {"dtype": "int64", "shape": [4], "values": [6, 7, 8, 9]},
    "weights": {"dtype": "float32", "shape": [4], "values": [1.0, 1.0, 1.0, 1.0]}}}


def add(loop: EngineLoop, *rows) -> None:
    with loop.sessions.begin() as db:
        db.add_all(rows)


def protobuf_body(body: dict, seq_id: int | None, forward_only: bool = False) -> bytes:
    """A JSON-form forward_backward body ({"model_id", "loss_fn", "loss_fn_config", "data"}) as the SDK sends it."""
    msg = pb.ForwardBackwardRequest(model_id=body.get("model_id", ""), seq_id=seq_id or 0, loss_fn=body["loss_fn"],
                                    forward_only=forward_only)
    for key, value in (body.get("loss_fn_config") or {}).items():
        msg.loss_fn_config[key] = value
    for d in body["data"]:
        datum = msg.data.add()
        datum.model_input.add().encoded_text.tokens = np.asarray(d["input_tokens"], np.int32).tobytes()
        for name, spec in d["loss_fn_inputs"].items():
            dtype = {"float32": (np.float32, pb.DTYPE_FLOAT32), "int64": (np.int64, pb.DTYPE_INT64)}[spec["dtype"]]
            t = datum.loss_fn_inputs[name]
            t.dense, t.dtype = np.asarray(spec["values"], dtype[0]).tobytes(), dtype[1]
            t.shape.extend(spec["shape"])
    return msg.SerializeToString()


def future(fid: str, kind: str, body: dict, model_id: str | None = None, seq_id: int | None = None,
           legacy_json: bool = False) -> FutureRecord:
    """A stored request. A forward / forward_backward is stored as the API stores it (datums in a protobuf body)
    unless legacy_json (the datums in the JSON, as rows stored before migration 0003)."""
    if kind in ("forward", "forward_backward") and "data" in body and not legacy_json:
        binary = protobuf_body(body, seq_id, forward_only=kind == "forward")
        meta = {k: v for k, v in body.items() if k != "data"}
        return FutureRecord(id=fid, request_type=kind, request=meta, request_body=binary,
                            request_hash=request_hash(meta, binary), model_id=model_id, seq_id=seq_id)
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
        return {f.id: f for f in db.scalars(select(FutureRecord).options(undefer(FutureRecord.request_body),
                                                                          undefer(FutureRecord.result_body)))}


def stored_result(f: FutureRecord) -> Any:
    """A finished future's result as JSON values: a binary ForwardBackwardOutput as {"loss_fn_outputs", "metrics"}."""
    if f.result_body is None:
        return f.result
    _, outputs, metrics = codec.decode_forward_backward_output(f.result_body)
    return {"loss_fn_outputs": [{k: v.tolist() for k, v in out.items()} for out in outputs], "metrics": metrics}


FULL_MODEL = "s:train:0"  # full_model_loop's model
SEEDED_SAMPLE = {"prompt_tokens": [5, 6, 7, 8], "num_samples": 2,
                 "sampling_params": {"max_tokens": 8, "temperature": 1.0, "seed": 1234}}


@contextlib.contextmanager
def full_model_loop(tmp_path, model_dir, model_id: str = FULL_MODEL) -> Iterator[EngineLoop]:
    """An EngineLoop on a fresh SQLite database with session "s" and a full fine-tune `model_id` already created
    (one adapter slot): the snapshot-memory tests' starting point; its snapshot memory is closed after."""
    from skyrl_tx.backend.native import NativeBackend
    from skyrl_tx.checkpoints.store import CheckpointStore
    from skyrl_tx.config import BackendSettings
    from skyrl_tx.db import migrate
    from skyrl_tx.db.session import make_engine, make_session_factory
    from skyrl_tx.engine.checkpointing import Checkpointer

    url = f"sqlite:///{tmp_path / 'engine.db'}"
    migrate.upgrade(url)
    backend = NativeBackend(model_dir, BackendSettings(max_lora_adapters=1))
    sessions = make_session_factory(make_engine(url))
    checkpointer = Checkpointer(backend, CheckpointStore(str(tmp_path / "checkpoints")), sessions, model_dir)
    loop = EngineLoop(backend, sessions, checkpointer, session_timeout_s=600)
    add(loop, SessionRecord(id="s", last_heartbeat_at=datetime.now(timezone.utc)))
    add(loop, ModelRecord(id=model_id, session_id="s", base_model="tiny-qwen3", lora_rank=0),
        future(f"{model_id}:create", "create_model", {"model_id": model_id, "lora_rank": 0, "seed": 1,
                                                      "train_attn": True, "train_mlp": True, "train_unembed": True}))
    loop.step()
    try:
        yield loop
    finally:
        loop.checkpointer.snapshot_memory.close()
