"""Recovery snapshots bound an engine restart: it replays only the requests after the newest usable snapshot and
rebuilds exactly the weights and AdamW state of the undisturbed engine (real core, real SQLite, tiny model)."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import select

from engine_restart import FB, MODEL, STEP, Server, assert_same_state, restart
from skyrl_tx.db.models import FutureRecord, RecoverySnapshotRecord
from skyrl_tx.engine import executor, recovery_state


@pytest.mark.parametrize("rank", [4, 0], ids=["lora", "full"])
def test_restart_starts_from_the_newest_snapshot_and_rebuilds_the_same_state(
        tmp_path, tiny_model_dir, caplog, rank) -> None:
    server = Server(tmp_path, tiny_model_dir("tiny-qwen3"), every_steps=4)
    loop = server.engine()
    server.create(loop, rank)
    server.train(loop, 10)  # snapshots after steps 4 and 8 (seq 8, 16); steps 9, 10 come after
    server.submit("forward_backward", FB)  # gradients pending at the "crash": replayed too
    while loop.step():
        pass
    with server.sessions() as db:
        assert recovery_state.recovery_base(db, MODEL).seq_id == 16
        assert [s.seq_id for s in db.scalars(select(RecoverySnapshotRecord))] == [16]  # the older one was released
    # Directories a dead engine left without a row (died between publish and record, or mid-write) go at start.
    with server.sessions() as db:
        kept = db.scalar(select(RecoverySnapshotRecord.location))
    orphans = [Path(kept).with_name("000000000099"), Path(kept).with_name("000000000100.partial-0123456789ab")]
    for orphan in orphans:
        orphan.mkdir()
        (orphan / "optimizer.safetensors").write_bytes(b"half")
    restarted, counts, _ = restart(server, caplog)
    assert counts == {MODEL: 5}  # seq 17..21, not the 21 since create
    assert Path(kept).is_dir() and not any(orphan.exists() for orphan in orphans)
    assert_same_state(loop.backend, restarted.backend)
    # Training goes on identically from the restored state (pending gradients, AdamW step count and moments).
    for engine in (loop, restarted):
        engine.backend.optim_step(MODEL, executor.adam_params(STEP))
    assert_same_state(loop.backend, restarted.backend)


def test_a_snapshot_whose_optim_step_was_not_stored_is_not_used(tmp_path, tiny_model_dir, caplog) -> None:
    """The engine can die after copying the state but before storing the step's result: that step runs again
    after the restart, so starting from the snapshot would apply it twice."""
    server = Server(tmp_path, tiny_model_dir("tiny-qwen3"), every_steps=2)
    loop = server.engine()
    server.create(loop, 4)
    server.train(loop, 3)  # snapshot after step 2 (seq 4)
    with server.sessions.begin() as db:
        db.get(FutureRecord, f"{MODEL}:4").status = "running"
    with server.sessions() as db:
        assert recovery_state.recovery_base(db, MODEL) is None


def test_kept_sampler_snapshots_older_than_the_newest_snapshot_are_rebuilt(tmp_path, tiny_model_dir, caplog) -> None:
    server = Server(tmp_path, tiny_model_dir("tiny-qwen3"), every_steps=2)
    loop = server.engine()
    server.create(loop, 4)
    server.train(loop, 2)  # snapshot at seq 4
    server.submit("save_weights_for_sampler", {"model_id": MODEL, "path": None, "sampling_session_id": "s:sample:0"})
    server.train(loop, 2)  # snapshot at seq 9, newer than the sampler
    with server.sessions() as db:
        assert recovery_state.recovery_base(db, MODEL).seq_id == 4
    restarted, counts, _ = restart(server, caplog)
    assert counts == {MODEL: 5}  # the sampler save (seq 5) and the 2 steps after it
    assert restarted.backend.has_snapshot("s:sample:0")
    assert_same_state(loop.backend, restarted.backend)


def test_restart_after_1000_steps_replays_no_more_than_after_10(tmp_path, tiny_model_dir, caplog) -> None:
    """The acceptance check: recovery work is bounded by the snapshot interval, not by the history."""
    every = 8
    short = Server(tmp_path / "short", tiny_model_dir("tiny-qwen3"), every_steps=every)
    long = Server(tmp_path / "long", tiny_model_dir("tiny-qwen3"), every_steps=every)
    runs = {}
    for server, steps in ((short, 10), (long, 1000)):
        loop = server.engine()
        server.create(loop, 4)
        server.train(loop, steps, chunk=50)
        server.submit("forward_backward", FB)  # a tail after the newest snapshot
        while loop.step():
            pass
        restarted, counts, seconds = restart(server, caplog)
        assert_same_state(loop.backend, restarted.backend)
        runs[steps] = (counts[MODEL], seconds)
    print(f"\nreplayed requests / recover() seconds: after 10 steps {runs[10]}, after 1000 steps {runs[1000]}")
    assert runs[1000][0] <= 2 * runs[10][0]
    assert runs[1000][0] <= 2 * every + 1
