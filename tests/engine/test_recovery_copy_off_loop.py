"""A recovery snapshot's copy runs off the engine loop: while the copy of one model's state is held (on an event
this test controls), another model trains and samples; the held model's own next requests wait, so the snapshot is
exactly the state right after the optim_step it follows."""

from __future__ import annotations

import threading
from datetime import datetime, timezone
from typing import Any

import pytest
import torch
from sqlalchemy import select

from skyrl_tx.checkpoints import formats
from skyrl_tx.db.models import ModelRecord, RecoverySnapshotRecord, SessionRecord
from skyrl_tx.engine import recovery_state
from skyrl_tx.engine.loop import EngineLoop
from skyrl_tx.engine.recovery_state import RecoverySnapshots

from engine_rows import DATUM, add, create, future, results

FULL, LORA = "a:train:0", "b:train:0"
GATE_S = 60.0  # only breaks a deadlock: the engine thread itself waiting on the gate (the copy on the loop)
SAMPLE = {"prompt_tokens": [5, 6, 7, 8], "num_samples": 1, "sampling_params": {"max_tokens": 4, "temperature": 0.0}}


def _fb(model: str) -> dict:
    return {"model_id": model, "loss_fn": "cross_entropy", "loss_fn_config": {}, "data": [DATUM]}


def _step(model: str) -> dict:
    return {"model_id": model, "adam_params": {"learning_rate": 0.05}}


class Gate:
    """Holds every copy of FULL's state for a recovery snapshot, on whichever thread makes it, until opened."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.held = threading.Event()  # a copy reached the gate
        self.timed_out = False

    def wait(self) -> None:
        self.held.set()
        if not self.opened.wait(GATE_S):
            self.timed_out = True


class GatedBackend:
    """The backend the recovery snapshots see: copies of FULL's state wait at the gate."""

    def __init__(self, backend: Any, gate: Gate) -> None:
        self._backend, self._gate = backend, gate

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def trainable_state(self, model_id: str, *args: Any, **kwargs: Any) -> Any:
        if model_id == FULL:
            self._gate.wait()
        return self._backend.trainable_state(model_id, *args, **kwargs)

    def optimizer_state(self, model_id: str) -> Any:
        if model_id == FULL:
            self._gate.wait()
        return self._backend.optimizer_state(model_id)


def _until(loop: EngineLoop, ids: list[str], steps: int = 3000) -> dict:
    for _ in range(steps):
        done = results(loop)
        if all(done[i].status in ("completed", "failed") for i in ids):
            return done
        loop.step()
    raise AssertionError(f"{ids} did not finish")


def test_another_model_trains_and_samples_while_a_recovery_copy_is_held(loop: EngineLoop, monkeypatch) -> None:
    gate = Gate()
    copies = recovery_state.host_copies if hasattr(recovery_state, "host_copies") else None

    def gated_copies(weights: dict, optimizer: Any) -> Any:
        if not any(".lora_" in name for name in weights):  # FULL's (LORA's factors have PEFT names)
            gate.wait()
        return copies(weights, optimizer)

    monkeypatch.setattr(recovery_state, "host_copies", gated_copies, raising=False)
    snapshots = loop._recovery_snapshots = RecoverySnapshots(
        GatedBackend(loop.backend, gate), loop.checkpointer.store, loop.sessions, every_steps=1, every_s=1e9)
    add(loop, SessionRecord(id="a", last_heartbeat_at=datetime.now(timezone.utc)))
    add(loop, ModelRecord(id=FULL, session_id="a", base_model="tiny-qwen3", lora_rank=0),
        future(f"{FULL}:create", "create_model", {"model_id": FULL, "lora_rank": 0, "seed": 1, "train_attn": True,
                                                  "train_mlp": True, "train_unembed": True}))
    create(loop, "b", LORA)
    add(loop, future(f"{FULL}:1", "forward_backward", _fb(FULL), FULL, 1),
        future(f"{FULL}:2", "optim_step", _step(FULL), FULL, 2),
        future(f"{FULL}:3", "forward_backward", _fb(FULL), FULL, 3),
        future(f"{FULL}:4", "optim_step", _step(FULL), FULL, 4))
    for _ in range(100):  # one step at a time: the state right after optim_step 2, before anything else of FULL
        loop.step()
        if results(loop)[f"{FULL}:2"].status == "completed":
            break
    assert results(loop)[f"{FULL}:2"].status == "completed"
    expected = loop.backend.trainable_state(FULL)
    expected_optimizer = loop.backend.optimizer_state(FULL)

    add(loop, future(f"{LORA}:1", "forward_backward", _fb(LORA), LORA, 1),
        future(f"{LORA}:2", "optim_step", _step(LORA), LORA, 2),
        future(f"{LORA}:3", "save_weights_for_sampler", {"model_id": LORA, "sampling_session_id": "b:sample:0"},
               LORA, 3))
    _until(loop, [f"{LORA}:{i}" for i in (1, 2, 3)])
    add(loop, future("sample", "sample", {**SAMPLE, "weights_id": "b:sample:0"}))
    _until(loop, ["sample"])
    done = results(loop)
    assert all(done[f"{LORA}:{i}"].status == "completed" for i in (1, 2, 3)) and done["sample"].status == "completed"
    assert gate.held.is_set() and not gate.timed_out, "the copy held the engine loop"
    assert done[f"{FULL}:3"].status == "pending"  # the copied model's own queue waits for its copy

    gate.opened.set()
    snapshots.flush()  # written (a later snapshot of FULL would replace it: read it before FULL steps again)
    with loop.sessions() as db:
        snap = db.scalars(select(RecoverySnapshotRecord).where(RecoverySnapshotRecord.model_id == FULL,
                                                               RecoverySnapshotRecord.seq_id == 2)).one()
    read = lambda name: loop.checkpointer.store.read(snap.location, name)  # noqa: E731
    weights = formats.read_weights(read, formats.read_meta(read))
    optimizer = formats.read_optimizer(read)
    assert weights.keys() == expected.keys() and all(torch.equal(weights[k], expected[k]) for k in expected)
    assert optimizer["step"] == expected_optimizer.step == 1
    for part in ("exp_avg", "exp_avg_sq"):
        want = getattr(expected_optimizer, part)
        assert optimizer[part].keys() == want.keys() and all(torch.equal(optimizer[part][k], want[k]) for k in want)
    done = _until(loop, [f"{FULL}:3", f"{FULL}:4"])  # the copy done, FULL goes on
    assert done[f"{FULL}:4"].status == "completed"
    assert not all(torch.equal(expected[k], loop.backend.trainable_state(FULL)[k]) for k in expected)
    snapshots.close()


@pytest.fixture(autouse=True)
def _close_snapshot_memory(loop: EngineLoop):
    yield
    loop.checkpointer.snapshot_memory.close()
