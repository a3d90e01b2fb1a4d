"""The retention sweep deletes old finished futures in bounded batches, never one that recovery or ordering of a live
model needs: after it, a restart still rebuilds the undisturbed engine's exact state (real core, real SQLite)."""

from __future__ import annotations

import os
from datetime import datetime, timedelta, timezone

from sqlalchemy import select, update

from engine_restart import MODEL, Server, assert_same_state, fb, restart
from skyrl_tx.db.models import FutureRecord, RecoverySnapshotRecord, StabilityUseRecord, request_hash
from skyrl_tx.engine import recovery_state
from skyrl_tx.engine.retention import maybe_sweep, sweep_retention

GONE = "t:train:0"  # a model that is unloaded: nothing of it is needed any more


def future_ids(server: Server) -> set[str]:
    with server.sessions() as db:
        return set(db.scalars(select(FutureRecord.id)))


def test_sweep_keeps_what_recovery_needs_and_deletes_the_rest_in_batches(tmp_path, tiny_model_dir, caplog) -> None:
    server = Server(tmp_path, tiny_model_dir("tiny-qwen3"), every_steps=4)
    loop = server.engine()
    server.create(loop, 4)
    server.create(loop, 4, model=GONE)
    server.train(loop, 10)  # snapshots after seq 8 and 16 of MODEL: its recovery base is seq 16
    server.train(loop, 4, model=GONE)
    with server.sessions() as db:
        gone_snapshots = [s.location for s in db.scalars(select(RecoverySnapshotRecord).where(
            RecoverySnapshotRecord.model_id == GONE))]
    assert gone_snapshots and all(os.path.isdir(p) for p in gone_snapshots)
    with server.sessions.begin() as db:
        db.add(FutureRecord(id="sample:1", request_type="sample", request={}, request_hash=request_hash({}),
                            status="completed", completed_at=datetime.now(timezone.utc)))
    server.submit("unload_model", {"model_id": GONE}, model=GONE)
    server.submit("forward_backward", fb())  # gradients pending, and one request still pending:
    while loop.step():
        pass
    server.submit("forward_backward", fb())
    with server.sessions.begin() as db:  # the unload has no seq_id in the API; here it took one
        db.execute(update(FutureRecord).where(FutureRecord.id == f"{GONE}:9").values(seq_id=None))
    before = future_ids(server)

    assert sweep_retention(loop, retention_hours=24) == 0  # nothing is old yet
    assert maybe_sweep(loop) == 0  # a periodic sweep ran: the next one is due in a minute

    with server.sessions.begin() as db:  # everything finished so far becomes two days old
        db.execute(update(FutureRecord).where(FutureRecord.completed_at.is_not(None)).values(
            completed_at=datetime.now(timezone.utc) - timedelta(days=2)))
    assert maybe_sweep(loop) == 0  # not due yet, although there is work now
    sweeps = []
    while (deleted := sweep_retention(loop, retention_hours=24, batch=5)) > 0:
        sweeps.append(deleted)
    assert max(sweeps) <= 5 and len(sweeps) >= 3  # bounded work per sweep

    kept = future_ids(server)
    assert kept == {f"{MODEL}:create"} | {f"{MODEL}:{seq}" for seq in range(16, 23)}
    assert before - kept >= {f"{GONE}:create", f"{GONE}:1", "sample:1", f"{MODEL}:1", f"{MODEL}:15"}
    with server.sessions() as db:
        assert [s.model_id for s in db.scalars(select(RecoverySnapshotRecord))] == [MODEL]
        assert recovery_state.recovery_base(db, MODEL).seq_id == 16
    assert not any(os.path.exists(p) for p in gone_snapshots)

    # What is left is enough: a restart rebuilds the same state, and the pending request still runs in order.
    restarted, counts, _ = restart(server, caplog)
    assert counts == {MODEL: 5}  # seq 17..21
    assert_same_state(loop.backend, restarted.backend)
    for engine in (loop, restarted):
        while engine.step():
            pass
        with server.sessions.begin() as db:  # the undisturbed engine ran seq 22 first; the restarted one too
            db.get(FutureRecord, f"{MODEL}:22").status = "pending"
    assert_same_state(loop.backend, restarted.backend)


def test_a_live_model_without_a_snapshot_keeps_its_whole_history(tmp_path, tiny_model_dir, caplog) -> None:
    server = Server(tmp_path, tiny_model_dir("tiny-qwen3"), every_steps=0)  # snapshots off
    loop = server.engine()
    server.create(loop, 4)
    server.train(loop, 3)
    with server.sessions.begin() as db:
        db.execute(update(FutureRecord).values(completed_at=datetime.now(timezone.utc) - timedelta(days=2)))
    assert sweep_retention(loop, retention_hours=24) == 0
    restarted, counts, _ = restart(server, caplog)
    assert counts == {MODEL: 6}
    assert_same_state(loop.backend, restarted.backend)


def test_a_recorded_sample_stays_while_datums_name_it_and_goes_a_day_after_its_last_use(tmp_path,
                                                                                       tiny_model_dir) -> None:
    server = Server(tmp_path, tiny_model_dir("tiny-qwen3"), every_steps=0)
    loop = server.engine()
    now = datetime.now(timezone.utc)
    with server.sessions.begin() as db:  # two samples finished two days ago; a datum named one an hour ago
        for name in ("sample:used", "sample:stale"):
            db.add(FutureRecord(id=name, request_type="sample", request={"record_stability_info": True},
                                request_hash=request_hash({}), status="completed",
                                completed_at=now - timedelta(days=2)))
        db.add(StabilityUseRecord(request_id="sample:used", last_used_at=now - timedelta(hours=1)))
        db.add(StabilityUseRecord(request_id="sample:stale", last_used_at=now - timedelta(days=1, minutes=1)))
    assert sweep_retention(loop, retention_hours=24) == 1
    assert future_ids(server) == {"sample:used"}
    with server.sessions() as db:
        assert set(db.scalars(select(StabilityUseRecord.request_id))) == {"sample:used"}
