"""RecoverySnapshots: periodic internal snapshots of each model's state, so a restart replays only a bounded tail.

Right after an optim_step (when no gradients are pending) every SNAPSHOT_EVERY_STEPS optim steps, or after
SNAPSHOT_EVERY_S seconds, the model's trainable tensors and optimizer state are copied to host memory; a
background thread serialises them, publishes the directory atomically in the checkpoint store (temp name,
rename), fsyncs it, and only then records a RecoverySnapshotRecord. A restart (engine/replay.py) loads the
newest usable snapshot and replays only the completed requests after it.

The copy runs off the engine thread (for a bf16 8B full fine-tune it is ~96 GB of float32 masters and moments):
the engine thread takes views of the live tensors (backend.state_views, no copy) and a copier thread copies them,
while the loop goes on serving other models and every sample. The snapshot must be the state right after that
optim_step, so until the copy ends the model's own queue is held (hold_copying, called by each loop step): none
of its requests runs, and nothing else writes its tensors. A backend whose state is split over ranks (tensor
parallelism, ZeRO) has no views: its copies are made on the engine thread, as the collectives require.

A snapshot is usable when the optim_step it follows is stored as completed (the engine can die between the copy
and storing that result: the step then runs again) and when it does not postdate a sampler snapshot the
server still keeps (those are rebuilt by replaying the save that made them). `recovery_base` is the single
definition of "usable": the retention sweep (engine/retention.py) keeps every request after it.

Settings (--backend-config, host-only): recovery_snapshot_every_steps (default 50, 0 = never) and
recovery_snapshot_every_s (default 600).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from skyrl_tx.checkpoints import formats
from skyrl_tx.checkpoints.store import CheckpointStore
from skyrl_tx.db.models import (FutureRecord, FutureStatus, ModelRecord, RecoverySnapshotRecord,
                                SamplingSessionRecord)
from skyrl_tx.engine import snapshots
from skyrl_tx.errors import UnimplementedError

log = logging.getLogger("skyrl_tx.engine")

RECOVERY_DIR = "_recovery"  # under the checkpoint store's root; never a training run id (those contain ':')
SNAPSHOT_EVERY_STEPS = 50  # defaults of the backend-config keys recovery_snapshot_every_steps / _every_s
SNAPSHOT_EVERY_S = 600.0
COPY_THREADS = 8  # recovery copies in flight at once (each of a different model: a copying model does not step)


def recovery_base(db: Session, model_id: str) -> RecoverySnapshotRecord | None:
    """The newest snapshot a restart may start from (None: replay from create). Everything of the model after
    its seq_id is needed by recovery; everything before it is not."""
    kept = [t for (t,) in db.execute(select(SamplingSessionRecord.created_at).where(
        SamplingSessionRecord.model_id == model_id, SamplingSessionRecord.snapshot_id.is_not(None),
        SamplingSessionRecord.model_path.is_(None)).order_by(SamplingSessionRecord.created_at.desc())
        .limit(snapshots.KEEP_PER_MODEL))]
    oldest_sampler = min(kept, default=None)
    completed = set(db.scalars(select(FutureRecord.seq_id).where(
        FutureRecord.model_id == model_id, FutureRecord.request_type == "optim_step",
        FutureRecord.status == FutureStatus.COMPLETED.value,
        FutureRecord.seq_id.in_(select(RecoverySnapshotRecord.seq_id).where(
            RecoverySnapshotRecord.model_id == model_id)))))
    for snap in db.scalars(select(RecoverySnapshotRecord).where(RecoverySnapshotRecord.model_id == model_id)
                           .order_by(RecoverySnapshotRecord.seq_id.desc())):
        if snap.seq_id in completed and (oldest_sampler is None or snap.taken_at < oldest_sampler):
            return snap
    return None


def load(backend: Any, store: CheckpointStore, snap: RecoverySnapshotRecord, model_id: str) -> None:
    """Restores a snapshot's weights and optimizer state into a freshly created model."""
    read = lambda name: store.read(snap.location, name)  # noqa: E731
    meta = formats.read_meta(read)
    backend.set_trainable_state(model_id, formats.read_weights(read, meta))
    backend.restore_optimizer(model_id, formats.read_optimizer(read))


def snapshotter(loop: Any) -> RecoverySnapshots:
    """The loop's RecoverySnapshots (made on first use)."""
    found = getattr(loop, "_recovery_snapshots", None)
    if found is None:
        settings = getattr(loop.backend, "settings", None)
        found = loop._recovery_snapshots = RecoverySnapshots(
            loop.backend, loop.checkpointer.store, loop.sessions,
            every_steps=getattr(settings, "recovery_snapshot_every_steps", SNAPSHOT_EVERY_STEPS),
            every_s=getattr(settings, "recovery_snapshot_every_s", SNAPSHOT_EVERY_S))
        # A copy that ends wakes an idle engine (run_engine sets the saves' wake-up) so the held model goes on.
        found.on_copied = lambda: loop.checkpointer.saves.on_done()
    return found


class RecoverySnapshots:
    """after_optim_step and hold_copying run on the engine thread; copies on the copier threads, writes on one
    writer thread."""

    def __init__(self, backend: Any, store: CheckpointStore, sessions: sessionmaker[Session],
                 every_steps: int = SNAPSHOT_EVERY_STEPS, every_s: float = SNAPSHOT_EVERY_S,
                 wait_if_busy: bool = False):
        self.backend = backend
        self.store = store
        self.sessions = sessions
        self.every_steps = every_steps
        self.every_s = every_s
        # A due snapshot while the model's previous one is still being written is skipped (taken after a later
        # step) unless wait_if_busy: then the engine waits for the write (and for each copy), which makes the
        # snapshot points exact.
        self.wait_if_busy = wait_if_busy
        self._steps: dict[str, int] = {}  # model id → optim steps since its last snapshot
        self._last: dict[str, float] = {}  # model id → monotonic time of its last snapshot (or first step seen)
        self._writing: dict[str, Future[None]] = {}  # at most one write in flight per model (bounds memory)
        self._copying: dict[str, Future[None]] = {}  # model id → its copy off the engine thread (its queue waits)
        self._lock = threading.Lock()  # _writing is set by the copier thread
        # Copies of different models run side by side: one model's long copy must not hold another model's queue.
        self._copier = ThreadPoolExecutor(max_workers=COPY_THREADS, thread_name_prefix="skyrl-tx-recovery-copy")
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="skyrl-tx-recovery-snapshots")
        self.on_copied: Any = lambda: None  # called on the copier thread when a copy ends

    def after_optim_step(self, model_id: str, seq_id: int | None) -> bool:
        """Called right after a successful optim_step of `model_id` (stored with `seq_id`); takes a snapshot when
        one is due. Never raises: the step already changed the model, and a missed snapshot only costs replay."""
        if self.every_steps <= 0 or seq_id is None:
            return False
        now = time.monotonic()
        steps = self._steps[model_id] = self._steps.get(model_id, 0) + 1
        last = self._last.setdefault(model_id, now)
        if steps < self.every_steps and now - last < self.every_s:
            return False
        with self._lock:
            busy = self._writing.get(model_id)
        if busy is not None and not busy.done():
            if not self.wait_if_busy:
                return False
            busy.exception()  # the previous one is still being written: try again after the next step
        try:
            taken_at = datetime.now(timezone.utc)
            views = self._views(model_id)
            if views is None:  # split over ranks: copied here, where the collectives run
                state = self.backend.trainable_state(model_id)  # host float32 copies: training may go on at once
                optimizer = self.backend.optimizer_state(model_id)  # host copies of the AdamW moments
                self._submit_write(model_id, seq_id, taken_at, state, optimizer)
            else:
                self._copying[model_id] = self._copier.submit(self._copy, model_id, seq_id, taken_at, *views)
                if self.wait_if_busy:  # exact snapshot points (tests): the engine waits for the copy too
                    self._copying[model_id].exception()
        except Exception:  # noqa: BLE001
            log.exception("recovery snapshot of model %s failed (replay after a restart will be longer)", model_id)
            return False
        self._steps[model_id], self._last[model_id] = 0, now
        return True

    def hold_copying(self, by_model: dict[str, list[Any]]) -> None:
        """Engine thread, each loop step: the queue of a model whose state is being copied waits (emptied for this
        step; its requests stay pending), so the copy is of the state right after its optim_step."""
        for model_id, copy in list(self._copying.items()):
            if copy.done():
                del self._copying[model_id]
            elif model_id in by_model:
                by_model[model_id].clear()

    def copying(self, model_id: str) -> bool:
        copy = self._copying.get(model_id)
        return copy is not None and not copy.done()

    def flush(self) -> None:
        """Waits for the copies and writes in flight (tests, shutdown)."""
        for f in list(self._copying.values()):
            f.exception()
        with self._lock:
            writing = list(self._writing.values())
        for f in writing:
            f.exception()

    def close(self) -> None:
        self._copier.shutdown(wait=True)
        self._writer.shutdown(wait=True)

    def _views(self, model_id: str) -> tuple[dict[str, Any], Any] | None:
        views = getattr(self.backend, "state_views", None)
        if views is None:
            return None
        try:
            weights, optimizer = views(model_id)
        except UnimplementedError:
            return None
        if any(t.is_cuda for t in weights.values()):
            import torch

            # The step's kernels may still be queued on the engine thread's stream: the copier's stream must not
            # read the tensors before they finish.
            torch.cuda.synchronize()
        return weights, optimizer

    def _submit_write(self, model_id: str, seq_id: int, taken_at: datetime, state: dict[str, Any],
                      optimizer: Any) -> None:
        with self._lock:
            self._writing[model_id] = self._writer.submit(self._write, model_id, seq_id, taken_at, state, optimizer)

    # ---- copier thread -----------------------------------------------------------------------------
    def _copy(self, model_id: str, seq_id: int, taken_at: datetime, weights: dict[str, Any], optimizer: Any) -> None:
        """Host float32 copies of the views (what trainable_state and optimizer_state return), then the write."""
        try:
            state, host = host_copies(weights, optimizer)
            self._submit_write(model_id, seq_id, taken_at, state, host)
        except Exception:  # noqa: BLE001 - a missed snapshot only makes a later replay longer
            log.exception("copying the recovery snapshot of model %s failed", model_id)
        finally:
            del weights, optimizer  # the views: nothing of the model is held past the copy
            try:
                self.on_copied()
            except Exception:  # noqa: BLE001 - a failed wake-up only delays the model to the engine's idle poll
                log.exception("recovery copy finished, but waking the engine failed")

    # ---- background thread -------------------------------------------------------------------------
    def _write(self, model_id: str, seq_id: int, taken_at: datetime, state: dict[str, Any], optimizer: Any) -> None:
        try:
            from skyrl_tx.engine.checkpointing import model_meta  # imports executor (torch): the engine side only

            with self.sessions() as db:
                model = db.get(ModelRecord, model_id)
                if model is None:
                    return
                meta = model_meta(model, int(optimizer.step))
            files = formats.trainable_files(meta, state) | formats.optimizer_files(optimizer)
            files[formats.STATE_FILE] = formats.json_bytes(meta.to_json())
            location = f"{self.store.root}/{RECOVERY_DIR}/{model_id.replace(':', '-').replace('/', '-')}/{seq_id:012d}"
            size = self.store.publish(location, files, overwrite=True)
            if self.store.is_local:
                _fsync_tree(location)
            with self.sessions.begin() as db:  # usable from here on
                db.add(RecoverySnapshotRecord(model_id=model_id, seq_id=seq_id, optimizer_step=int(optimizer.step),
                                              location=location, size_bytes=size, taken_at=taken_at))
            log.info("recovery snapshot of model %s after seq_id %d (%d bytes)", model_id, seq_id, size)
            self.release_older(model_id)
        except Exception:  # noqa: BLE001 - a missed snapshot only makes a later replay longer
            log.exception("writing the recovery snapshot of model %s failed", model_id)

    def release_older(self, model_id: str) -> int:
        """Deletes the model's snapshots older than its recovery base (they can never be used again)."""
        with self.sessions.begin() as db:
            base = recovery_base(db, model_id)
            if base is None:
                return 0
            old = list(db.scalars(select(RecoverySnapshotRecord).where(
                RecoverySnapshotRecord.model_id == model_id, RecoverySnapshotRecord.seq_id < base.seq_id)))
            for snap in old:
                self.store.delete(snap.location)
                db.delete(snap)
        return len(old)

    def remove_orphans(self) -> int:
        """At engine start: snapshot directories with no row (the engine died between publish and record)."""
        with self.sessions() as db:
            known = set(db.scalars(select(RecoverySnapshotRecord.location)))
        root = f"{self.store.root}/{RECOVERY_DIR}"
        try:
            found = [p for p in self.store.fs.find(root, withdirs=True, maxdepth=2) if p.count("/") == root.count("/") + 2]
        except (FileNotFoundError, OSError):
            return 0
        removed = 0
        for p in found:
            if p not in known and self.store.fs.isdir(p):
                self.store.delete(p)
                removed += 1
        return removed


@dataclass
class HostOptimizerState:
    """optimizer_state's fields as host copies (what formats.optimizer_files reads)."""

    kind: str
    step: int
    exp_avg: dict[str, Any]
    exp_avg_sq: dict[str, Any]
    momentum: dict[str, Any]
    master: dict[str, Any]


def host_copies(weights: dict[str, Any], optimizer: Any) -> tuple[dict[str, Any], HostOptimizerState]:
    """Float32 CPU copies of state_views' tensors (torch releases the GIL while each copies)."""
    import torch

    def copy(tensors: dict[str, Any]) -> dict[str, Any]:
        return {name: t.detach().to("cpu", torch.float32, copy=True) for name, t in tensors.items()}

    return copy(weights), HostOptimizerState(optimizer.kind, int(optimizer.step), copy(optimizer.exp_avg),
                                             copy(optimizer.exp_avg_sq), copy(optimizer.momentum),
                                             copy(optimizer.master))


def _fsync_tree(location: str) -> None:
    """The files and the directory entries are on disk before the row that makes the snapshot usable."""
    for name in os.listdir(location):
        fd = os.open(os.path.join(location, name), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    for d in (location, os.path.dirname(location)):
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
