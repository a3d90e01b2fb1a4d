"""Checkpoint saves run off the engine loop: other users sample and train meanwhile, the saving model waits for
its save, a checkpoint is listed only once completely written, and full fine-tuning weights keep their dtype."""

from __future__ import annotations

import json
import threading
from datetime import datetime, timezone
from pathlib import Path

import pytest
import torch
from sqlalchemy import select

from skyrl_tx.backend.native import NativeBackend
from skyrl_tx.checkpoints.catalog import ready_checkpoint
from skyrl_tx.checkpoints.paths import TinkerPath
from skyrl_tx.checkpoints.store import CheckpointStore
from skyrl_tx.config import BackendSettings
from skyrl_tx.db import migrate
from skyrl_tx.db.models import CheckpointRecord, ModelRecord, SessionRecord
from skyrl_tx.db.session import make_engine, make_session_factory
from skyrl_tx.engine.checkpointing import Checkpointer
from skyrl_tx.engine.loop import EngineLoop
from skyrl_tx.errors import NotFoundError

from engine_rows import DATUM, add, create, future, results

STEP_LIMIT = 20_000  # a bound on every stepping loop below, so a hang fails instead of running forever


class SlowStore(CheckpointStore):
    """A local store that uploads like a remote bucket whose upload takes as long as the test needs: `ready` holds
    the writer inside publish until it is set; `entered` says a writer got there; `writers` names its threads."""

    def __init__(self, base_url: str):
        super().__init__(base_url)
        self.ready = threading.Event()
        self.ready.set()
        self.entered = threading.Event()
        self.writers: list[str] = []

    def publish(self, *args, **kwargs) -> int:
        self.writers.append(threading.current_thread().name.rsplit("_", 1)[0])  # pool threads: <prefix>_<n>
        self.entered.set()
        # Held on the engine's own thread, the loop would stop for as long: fail at once rather than at the bound.
        assert self.ready.is_set() or threading.current_thread() is not threading.main_thread(), \
            "the checkpoint is written on the engine loop's thread"
        assert self.ready.wait(300), "the test never let the upload go on"
        return super().publish(*args, **kwargs)


def make_loop(tmp_path: Path, model_dir: Path, **settings) -> EngineLoop:
    url = f"sqlite:///{tmp_path / 'engine.db'}"
    migrate.upgrade(url)
    backend = NativeBackend(model_dir, BackendSettings(max_lora_adapters=2, **settings))
    sessions = make_session_factory(make_engine(url))
    checkpointer = Checkpointer(backend, SlowStore(str(tmp_path / "checkpoints")), sessions, model_dir)
    return EngineLoop(backend, sessions, checkpointer, session_timeout_s=600)


def create_full(loop: EngineLoop, session: str, model_id: str, base_model: str) -> None:
    """A full fine-tuning model (lora_rank 0): its checkpoints hold every weight of the model."""
    add(loop, SessionRecord(id=session, last_heartbeat_at=datetime.now(timezone.utc)))
    add(loop, ModelRecord(id=model_id, session_id=session, base_model=base_model, lora_rank=0),
        future(f"{model_id}:create", "create_model", {"model_id": model_id, "lora_rank": 0, "seed": 1,
                                                      "train_attn": True, "train_mlp": True, "train_unembed": True}))
    loop.step()
    assert results(loop)[f"{model_id}:create"].status == "completed"


def step_until(loop: EngineLoop, done) -> None:
    for _ in range(STEP_LIMIT):
        if done():
            return
        loop.step()
    raise AssertionError("the engine did not finish the requests")


def checkpoint_status(loop: EngineLoop, path: TinkerPath) -> str | None:
    with loop.sessions() as db:
        return db.scalar(select(CheckpointRecord.status).where(CheckpointRecord.tinker_path == str(path)))


def test_saving_model_waits_while_others_train_and_the_checkpoint_is_listed_only_when_written(tmp_path,
                                                                                              tiny_model_dir):
    loop = make_loop(tmp_path, tiny_model_dir("tiny-qwen3"))
    create(loop, "a", "a:train:0")
    create(loop, "b", "b:train:0")
    path = TinkerPath("a:train:0", "weights", "step_1")
    fb = {"loss_fn": "cross_entropy", "loss_fn_config": {}, "data": [DATUM]}
    loop.checkpointer.store.ready.clear()  # the upload hangs until the test lets it go on
    add(loop, future("a:1", "forward_backward", {**fb, "model_id": "a:train:0"}, "a:train:0", 1),
        future("a:2", "save_weights", {"model_id": "a:train:0", "path": str(path)}, "a:train:0", 2),
        future("a:3", "optim_step", {"model_id": "a:train:0", "adam_params": {"learning_rate": 0.05}}, "a:train:0", 3),
        future("b:1", "forward_backward", {**fb, "model_id": "b:train:0"}, "b:train:0", 1))
    before = loop.backend.trainable_state("a:train:0")
    for _ in range(4):
        loop.step()
    done = results(loop)
    assert done["b:1"].status == "completed"  # another model trains while the save is in flight
    assert done["a:1"].status == "completed" and done["a:2"].status == "running"
    assert done["a:3"].status == "pending"  # the saving model waits for its save
    assert checkpoint_status(loop, path) == "writing"
    with loop.sessions() as db, pytest.raises(NotFoundError):
        ready_checkpoint(db, path, "load_weights")  # never listed half-written
    loop.checkpointer.store.ready.set()
    assert loop.checkpointer.saves.wait(timeout=60)
    step_until(loop, lambda: results(loop)["a:3"].status != "pending")
    done = results(loop)
    assert done["a:2"].status == "completed" and done["a:2"].result == {"path": str(path), "type": "save_weights"}
    assert done["a:3"].status == "completed"
    assert checkpoint_status(loop, path) == "ready"
    # The files hold the state at the save's seq_id, not the state after the optim_step that followed it.
    loaded = loop.checkpointer.store.files(loop.checkpointer.store.location(path))
    assert "adapter_model.safetensors" in loaded and "optimizer.safetensors" in loaded
    from safetensors.torch import load

    saved = load(loop.checkpointer.store.read(loop.checkpointer.store.location(path), "adapter_model.safetensors"))
    assert saved.keys() == before.keys()
    assert all(torch.equal(saved[k], before[k]) for k in before)
    assert not all(torch.equal(loop.backend.trainable_state("a:train:0")[k], before[k]) for k in before)


def test_full_finetune_checkpoint_keeps_the_model_dtype(tmp_path, tiny_model_dir):
    loop = make_loop(tmp_path, tiny_model_dir("tiny-qwen3"), dtype="bfloat16")
    create_full(loop, "a", "a:train:0", "tiny-qwen3")
    path = TinkerPath("a:train:0", "sampler_weights", "bf16")
    add(loop, future("a:1", "save_weights_for_sampler", {"model_id": "a:train:0", "path": str(path)}, "a:train:0", 1))
    loop.step()
    assert loop.checkpointer.saves.wait(timeout=60)
    step_until(loop, lambda: results(loop)["a:1"].status != "running")
    assert results(loop)["a:1"].status == "completed"
    raw = loop.checkpointer.store.read(loop.checkpointer.store.location(path), "model.safetensors")
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
    state = loop.backend.trainable_state("a:train:0")
    assert len(raw) < sum(t.numel() for t in state.values()) * 2 + 64 * 1024  # 2 bytes a weight + the header


def test_another_user_samples_to_completion_while_a_save_is_held_in_its_writer(tmp_path, tiny_model_dir):
    """The save's writing runs on the save worker, off the engine loop: while the writer is held inside publish (an
    event the test controls), the loop keeps stepping and another user's samples run from start to finish; the save
    completes once the writer is let go. (Its cost to the other user's throughput is measured by
    `python -m skyrl_tx.bench saves`, not here.)"""
    loop = make_loop(tmp_path, tiny_model_dir("tiny-qwen3"))
    create(loop, "a", "a:train:0")
    store = loop.checkpointer.store
    store.ready.clear()
    path = TinkerPath("a:train:0", "weights", "step_1")
    add(loop, future("a:1", "save_weights", {"model_id": "a:train:0", "path": str(path)}, "a:train:0", 1))
    loop.step()
    assert store.entered.wait(60), "the save never reached its writer"
    body = {"prompt_tokens": [1, 2, 3, 4, 5, 6, 7, 8], "num_samples": 1, "weights_id": ""}
    add(loop, *[future(f"b:{i}", "sample", {**body, "sampling_params": {"max_tokens": 16, "temperature": 1.0,
                                                                        "seed": i}}) for i in range(16)])
    step_until(loop, lambda: all(f.status == "completed" for i, f in results(loop).items() if i.startswith("b:")))
    assert results(loop)["a:1"].status == "running" and checkpoint_status(loop, path) == "writing"
    assert store.writers == ["skyrl-tx-saves"]  # the worker thread, never the engine's
    store.ready.set()
    assert loop.checkpointer.saves.wait(timeout=60)
    step_until(loop, lambda: results(loop)["a:1"].status != "running")
    assert results(loop)["a:1"].status == "completed" and checkpoint_status(loop, path) == "ready"
