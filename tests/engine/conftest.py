"""The `loop` fixture of the engine tests: an EngineLoop on the real core (tiny-qwen3, two adapter slots) and a
fresh SQLite database migrated by Alembic."""

from __future__ import annotations

import pytest

from skyrl_tx.backend.native import NativeBackend
from skyrl_tx.checkpoints.store import CheckpointStore
from skyrl_tx.config import BackendSettings
from skyrl_tx.db import migrate
from skyrl_tx.db.session import make_engine, make_session_factory
from skyrl_tx.engine.checkpointing import Checkpointer
from skyrl_tx.engine.loop import EngineLoop


@pytest.fixture()
def loop(tmp_path, tiny_model_dir) -> EngineLoop:
    url = f"sqlite:///{tmp_path / 'engine.db'}"
    migrate.upgrade(url)
    model_dir = tiny_model_dir("tiny-qwen3")
    backend = NativeBackend(model_dir, BackendSettings(max_lora_adapters=2))
    sessions = make_session_factory(make_engine(url))
    checkpointer = Checkpointer(backend, CheckpointStore(str(tmp_path / "checkpoints")), sessions, model_dir)
    return EngineLoop(backend, sessions, checkpointer, session_timeout_s=60)
