"""A Dimuon model survives an engine restart: rebuilt from its recovery snapshot (momentum included) plus the
replayed optim steps, it has exactly the undisturbed engine's weights and momentum, and goes on identically."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
import torch
from engine_restart import FB, MODEL, Server, restart

from skyrl_tx.db.models import FutureRecord, ModelRecord, SessionRecord, request_hash
from skyrl_tx.engine import executor
from skyrl_tx.errors import InvalidArgumentError

DIMUON_STEP = {"model_id": MODEL, "optimizer_params": {"type": "dimuon", "learning_rate": 0.01,
                                                       "grad_clip_norm": 1.0, "beta1": 0.9}}


def create_dimuon(server: Server, loop) -> None:
    """What the API stores for create_model with optimizer_config {type: dimuon, version: 1}."""
    lora = {"seed": 3, "train_attn": True, "train_mlp": True, "train_unembed": True, "optimizer": "dimuon"}
    body = {"model_id": MODEL, "lora_rank": 4, **lora}
    with server.sessions.begin() as db:
        db.add(SessionRecord(id="s", last_heartbeat_at=datetime.now(timezone.utc)))
    with server.sessions.begin() as db:
        db.add(ModelRecord(id=MODEL, session_id="s", base_model="tiny-qwen3", lora_rank=4,
                           lora_config={"rank": 4, **lora}))
        db.add(FutureRecord(id=f"{MODEL}:create", request_type="create_model", request=body,
                            request_hash=request_hash(body)))
    loop.step()


def assert_same_dimuon_state(a, b) -> None:
    wa, wb = a.trainable_state(MODEL), b.trainable_state(MODEL)
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=0, atol=1e-6, msg=name)
    oa, ob = a.optimizer_state(MODEL), b.optimizer_state(MODEL)
    assert (oa.kind, oa.step) == (ob.kind, ob.step) and oa.kind == "dimuon"
    assert oa.momentum.keys() == ob.momentum.keys() and oa.momentum
    for name in oa.momentum:
        torch.testing.assert_close(oa.momentum[name], ob.momentum[name], rtol=0, atol=1e-6, msg=name)


def test_dimuon_model_is_rebuilt_exactly_after_a_restart(tmp_path, tiny_model_dir, caplog) -> None:
    server = Server(tmp_path, tiny_model_dir("tiny-qwen3"), every_steps=2)
    loop = server.engine()
    create_dimuon(server, loop)
    assert loop.backend.optimizer_kind(MODEL) == "dimuon"
    for _ in range(3):  # a recovery snapshot after step 2; step 3 is replayed
        server.submit("forward_backward", FB)
        server.submit("optim_step", DIMUON_STEP)
    while loop.step():
        pass
    loop._recovery_snapshots.flush()
    assert loop.backend.optimizer_state(MODEL).step == 3
    restarted, counts, _ = restart(server, caplog)
    assert counts == {MODEL: 2}  # seq 5, 6: after the snapshot of seq 4
    assert restarted.backend.optimizer_kind(MODEL) == "dimuon"
    assert_same_dimuon_state(loop.backend, restarted.backend)
    for engine in (loop, restarted):
        engine.backend.optim_step(MODEL, executor.optim_params(DIMUON_STEP))
    assert_same_dimuon_state(loop.backend, restarted.backend)


def test_loading_dimuon_state_into_an_adamw_model_changes_nothing(tmp_path, tiny_model_dir) -> None:
    """The engine checks the family before touching the weights (the API refuses it earlier, at submit)."""
    server = Server(tmp_path, tiny_model_dir("tiny-qwen3"), every_steps=100)
    loop = server.engine()
    create_dimuon(server, loop)
    server.submit("forward_backward", FB)
    server.submit("optim_step", DIMUON_STEP)
    while loop.step():
        pass
    path = f"tinker://{MODEL}/weights/point"
    loop.checkpointer.save({"model_id": MODEL, "path": path})
    server.create(loop, 4, model="s:train:1")  # AdamW
    before = loop.backend.trainable_state("s:train:1")
    with pytest.raises(InvalidArgumentError, match="holds dimuon optimizer state.*uses adamw"):
        loop.checkpointer.load_into("s:train:1", path, with_optimizer=True)
    after = loop.backend.trainable_state("s:train:1")
    assert all(torch.equal(before[name], after[name]) for name in before)
    loop.checkpointer.load_into("s:train:1", path, with_optimizer=False)  # weights only: fine
    assert torch.equal(loop.backend.trainable_state("s:train:1")[next(iter(before))],
                       loop.backend.trainable_state(MODEL)[next(iter(before))])
