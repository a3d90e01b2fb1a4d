"""Checkpoint saves run off the engine loop: other users sample and train meanwhile, the saving model waits for
its save, a checkpoint is listed only once completely written, and full fine-tuning weights keep their dtype."""

from __future__ import annotations

import json
import threading
import time
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
from skyrl_tx.models.tiny_presets import generate_model

from engine_rows import DATUM, add, create, future, results

STEP_LIMIT = 20_000  # a bound on every stepping loop below, so a hang fails instead of running forever


class SlowStore(CheckpointStore):
    """A local store that uploads like a remote bucket: `ready` holds an upload back as long as a test needs, and
    `bytes_per_s` (when set) makes it take as long as at that bandwidth."""

    def __init__(self, base_url: str):
        super().__init__(base_url)
        self.ready = threading.Event()
        self.ready.set()
        self.bytes_per_s: float | None = None

    def publish(self, *args, **kwargs) -> int:
        assert self.ready.wait(60)
        started = time.perf_counter()
        size = super().publish(*args, **kwargs)
        if self.bytes_per_s:
            time.sleep(max(0.0, size / self.bytes_per_s - (time.perf_counter() - started)))
        return size


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


# ---- acceptance: another user's sampling throughput while a ~100 MB checkpoint is saved ---------------------
@pytest.fixture(scope="module")
def model_100mb(tmp_path_factory) -> Path:
    """tiny-qwen3 widened to ~29M parameters: ~118 MB of float32 weights."""
    return generate_model("tiny-qwen3", tmp_path_factory.mktemp("m100") / "tiny-qwen3-100mb", hidden_size=512,
                          intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
                          head_dim=64)


def sampling_seconds(loop: EngineLoop, tag: str, save: TinkerPath | None) -> float:
    """Wall time for 16 sampling requests of user "b" to finish, with user "a" saving at the same moment."""
    body = {"prompt_tokens": [1, 2, 3, 4, 5, 6, 7, 8], "num_samples": 1, "weights_id": "",
            "sampling_params": {"max_tokens": 48, "temperature": 1.0}}
    rows = [future(f"{tag}:{i}", "sample", {**body, "sampling_params": {**body["sampling_params"], "seed": i}})
            for i in range(16)]
    if save is not None:
        seq = int(save.name.rsplit("_", 1)[1])
        rows.append(future(f"a:{seq}", "save_weights", {"model_id": "a:train:0", "path": str(save)}, "a:train:0", seq))
    add(loop, *rows)
    started = time.perf_counter()
    ids = {f"{tag}:{i}" for i in range(16)}
    step_until(loop, lambda: all(results(loop)[i].status == "completed" for i in ids))
    return time.perf_counter() - started


def test_another_users_sampling_keeps_its_throughput_while_a_100mb_model_is_saved(tmp_path, model_100mb):
    loop = make_loop(tmp_path, model_100mb)
    # Uploaded at 100 MB/s, as to a bucket: ~1.2 s per save. (On a local disk the write takes ~0.3 s here; on the
    # engine loop, as before, a save at this bandwidth cut the other user's throughput to ~0.6 of its rate.)
    loop.checkpointer.store.bytes_per_s = 100e6
    create_full(loop, "a", "a:train:0", "tiny-qwen3-100mb")
    sampling_seconds(loop, "warm", None)  # first decode steps allocate the KV cache
    alone, with_save = [], []
    for round_ in range(1, 6):  # interleaved, so a busy machine slows both sides alike
        alone.append(sampling_seconds(loop, f"alone{round_}", None))
        path = TinkerPath("a:train:0", "weights", f"step_{round_}")
        with_save.append(sampling_seconds(loop, f"save{round_}", path))
        assert loop.checkpointer.saves.wait(timeout=120)
        step_until(loop, lambda save_id=f"a:{round_}": results(loop)[save_id].status != "running")
        assert results(loop)[f"a:{round_}"].status == "completed"
        assert checkpoint_status(loop, path) == "ready"
    size = sum(loop.checkpointer.store.files(loop.checkpointer.store.location(path)).values())
    assert size > 100e6  # the save really wrote a ~100 MB checkpoint
    ratio = min(alone) / min(with_save)  # best of five: other processes on a shared machine only add time
    print(f"sampling throughput while saving {size / 1e6:.0f} MB: {ratio:.2f} of its rate without the save "
          f"(alone {alone}, with the save {with_save})")
    assert ratio >= 0.8
