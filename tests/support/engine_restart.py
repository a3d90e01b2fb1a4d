"""An engine that can be restarted on the same database and checkpoint store (tests of recovery and retention)."""

from __future__ import annotations

import logging
import re
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest
import torch

from skyrl_tx.backend.native import NativeBackend
from skyrl_tx.checkpoints.store import CheckpointStore
from skyrl_tx.config import BackendSettings
from skyrl_tx.db import migrate
from skyrl_tx.db.models import FutureRecord, ModelRecord, SessionRecord, request_hash
from skyrl_tx.db.session import make_engine, make_session_factory
from skyrl_tx.engine.checkpointing import Checkpointer
from skyrl_tx.engine.loop import EngineLoop
from skyrl_tx.engine.recovery_state import RecoverySnapshots

MODEL = "s:train:0"
DATUM = {"input_tokens": [5, 6, 7, 8], "loss_fn_inputs": {
    "target_tokens": {"dtype": "int64", "shape": [4], "values": [6, 7, 8, 9]},
    "weights": {"dtype": "float32", "shape": [4], "values": [1.0, 1.0, 1.0, 1.0]}}}


def fb(model: str = MODEL) -> dict:
    return {"model_id": model, "loss_fn": "cross_entropy", "loss_fn_config": {}, "data": [DATUM]}


def step(model: str = MODEL) -> dict:
    return {"model_id": model, "adam_params": {"learning_rate": 0.01}}


FB, STEP = fb(), step()


class Server:
    """One database and checkpoint store; engines come and go on it (a restart = a new backend and loop)."""

    def __init__(self, tmp_path: Path, model_dir: Path, every_steps: int):
        self.url = f"sqlite:///{tmp_path / 'engine.db'}"
        migrate.upgrade(self.url)
        self.model_dir, self.every_steps = model_dir, every_steps
        self.sessions = make_session_factory(make_engine(self.url))
        self.store = CheckpointStore(str(tmp_path / "checkpoints"))
        self.seq: dict[str, int] = {}  # model id → last seq_id submitted

    def engine(self) -> EngineLoop:
        backend = NativeBackend(self.model_dir, BackendSettings(max_lora_adapters=2))
        loop = EngineLoop(backend, self.sessions, Checkpointer(backend, self.store, self.sessions, self.model_dir))
        loop._recovery_snapshots = RecoverySnapshots(backend, self.store, self.sessions, every_steps=self.every_steps,
                                                     every_s=1e9, wait_if_busy=True)  # exact snapshot points
        return loop

    def create(self, loop: EngineLoop, rank: int, model: str = MODEL) -> None:
        session = model.split(":")[0]
        body = {"model_id": model, "lora_rank": rank, "seed": 3, "train_attn": True, "train_mlp": True,
                "train_unembed": True}
        with self.sessions.begin() as db:
            if db.get(SessionRecord, session) is None:
                db.add(SessionRecord(id=session, last_heartbeat_at=datetime.now(timezone.utc)))
        with self.sessions.begin() as db:  # separate flushes: the ORM does not order rows without relationships
            db.add(ModelRecord(id=model, session_id=session, base_model="tiny-qwen3", lora_rank=rank))
            db.add(FutureRecord(id=f"{model}:create", request_type="create_model", request=body,
                                request_hash=request_hash(body)))
        loop.step()

    def submit(self, kind: str, body: dict, model: str = MODEL) -> None:
        seq = self.seq[model] = self.seq.get(model, 0) + 1
        with self.sessions.begin() as db:
            db.add(FutureRecord(id=f"{model}:{seq}", request_type=kind, request=body,
                                request_hash=request_hash(body), model_id=model, seq_id=seq))

    def train(self, loop: EngineLoop, steps: int, chunk: int = 25, model: str = MODEL) -> None:
        """`steps` × (forward_backward, optim_step), stored `chunk` steps at a time and run to completion."""
        for start in range(0, steps, chunk):
            for _ in range(min(chunk, steps - start)):
                self.submit("forward_backward", fb(model), model)
                self.submit("optim_step", step(model), model)
            while loop.step():
                pass
        loop._recovery_snapshots.flush()


def replayed(caplog: pytest.LogCaptureFixture) -> dict[str, int]:
    """model id → requests replayed, from recover()'s log."""
    found = (re.fullmatch(r"model (\S+) rebuilt from its request log \((\d+) requests replayed\)", r.getMessage())
             for r in caplog.records)
    return {m[1]: int(m[2]) for m in found if m}


def assert_same_state(a: NativeBackend, b: NativeBackend, model: str = MODEL) -> None:
    wa, wb = a.trainable_state(model), b.trainable_state(model)
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=0, atol=1e-6, msg=name)
    oa, ob = a.optimizer_state(model), b.optimizer_state(model)
    assert oa.step == ob.step
    for name in oa.exp_avg:
        torch.testing.assert_close(oa.exp_avg[name], ob.exp_avg[name], rtol=0, atol=1e-6)
        torch.testing.assert_close(oa.exp_avg_sq[name], ob.exp_avg_sq[name], rtol=0, atol=1e-6)


def restart(server: Server, caplog: pytest.LogCaptureFixture) -> tuple[EngineLoop, dict[str, int], float]:
    """A new engine on the same database recovers; returns it, the requests it replayed per model, its seconds."""
    caplog.clear()
    loop = server.engine()
    started = time.perf_counter()
    with caplog.at_level(logging.INFO, logger="skyrl_tx.engine"):
        loop.recover()
    return loop, replayed(caplog), time.perf_counter() - started
