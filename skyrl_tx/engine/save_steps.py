"""SaveSteps: how the engine loop runs saves: sampler snapshots at once, file saves on the background writer."""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from skyrl_tx.db.future_queries import FutureRow
from skyrl_tx.db.models import ModelRecord, SamplingSessionRecord
from skyrl_tx.engine import snapshots
from skyrl_tx.engine.checkpointing import Checkpointer
from skyrl_tx.engine.outcomes import error as _error, named as _named
from skyrl_tx.errors import ConflictError, SkyrlTxError

log = logging.getLogger("skyrl_tx.engine")


def _writes_files(f: FutureRow) -> bool:
    """Saves that write a checkpoint directory (an unnamed sampler snapshot lives in memory only)."""
    return f.request_type in ("save_weights", "save_weights_external") or (
        f.request_type == "save_weights_for_sampler" and not f.request.get("sampling_session_id"))


class SaveSteps:
    """The save requests' part of EngineLoop (engine/loop.py), which provides the attributes and bookkeeping below."""

    backend: Any
    checkpointer: Checkpointer
    sessions: sessionmaker[Session]

    def _mark_running(self, futures: list[FutureRow]) -> list[FutureRow]:
        raise NotImplementedError

    def _finish(self, f: FutureRow, *, result: Any = None, error: dict[str, Any] | None = None) -> None:
        raise NotImplementedError

    def _finish_many(self, done: list[tuple[FutureRow, Any, dict[str, Any] | None]]) -> None:
        raise NotImplementedError

    def _save_for_sampler(self, f: FutureRow) -> dict[str, Any]:
        request = f.request
        snapshot_id = request.get("sampling_session_id") or request["path"]
        if not request.get("sampling_session_id"):  # named: on disk (PEFT / HF format) and in memory
            result = self.checkpointer.save(request)
            self.checkpointer.remove_snapshot(snapshot_id)  # an overwrite: the old frozen weights are stale
            self.checkpointer.snapshot(request["model_id"], snapshot_id)
            with self.sessions() as db:
                snapshots.release_old_snapshots(self.backend, db, request["model_id"], self.checkpointer)
            return result
        self.checkpointer.snapshot(request["model_id"], snapshot_id)
        with self.sessions.begin() as db:
            model = db.get(ModelRecord, request["model_id"])
            inflight = bool(request.get("inflight"))
            db.add(SamplingSessionRecord(id=snapshot_id, session_id=model.session_id, base_model=model.base_model,
                                         model_id=model.id, snapshot_id=snapshot_id, inflight=inflight))
            if inflight:  # every inflight client of the model samples this snapshot from now on
                model.inflight_snapshot_id = snapshot_id
            db.flush()
            snapshots.release_old_snapshots(self.backend, db, model.id, self.checkpointer)
        return {"sampling_session_id": snapshot_id}

    # ---- background saves (engine/background_saves.py) ---------------------------------------------
    # A save that writes files takes host copies of the model's state on this thread, then serialises, writes and
    # uploads them on the save worker, so other models' training and all sampling go on meanwhile. The saving
    # model's later requests wait until the save is stored, although the copy already makes them safe for the
    # files: were they to run first, an engine crash during the write would rerun the save after them on
    # restart (replay rebuilds completed requests only) and save newer state under the old name.
    def _run_saves(self, by_model: dict[str, list[FutureRow]]) -> int:
        """Stores the saves that finished writing, then starts the file saves at the head of a model's queue.
        Returns how many queued requests it started."""
        self._store_finished_saves()
        started = 0
        for model_id, queue in by_model.items():
            if self.checkpointer.saves.busy(model_id):
                queue.clear()  # this model waits for its save
                continue
            first = next((i for i, f in enumerate(queue) if _writes_files(f)), None)
            if first is None:
                continue
            if first > 0:  # what precedes the save runs in this step; the save starts in the next one
                del queue[first:]
                continue
            f = queue.pop(0)
            queue.clear()
            self._start_save(f)
            started += 1
        return started

    def _start_save(self, f: FutureRow) -> None:
        if not self._mark_running([f]):
            return
        request = f.request
        try:
            pending = self.checkpointer.begin_save(request)
            if f.request_type == "save_weights_for_sampler":  # named: also frozen in memory, from this moment
                snapshot_id = request["path"]
                self.checkpointer.remove_snapshot(snapshot_id)  # an overwrite: the old frozen weights are stale
                self.checkpointer.snapshot(request["model_id"], snapshot_id)
                with self.sessions() as db:
                    snapshots.release_old_snapshots(self.backend, db, request["model_id"], self.checkpointer)
        except Exception as exc:  # noqa: BLE001 - every failure becomes the future's error
            if not isinstance(exc, SkyrlTxError):
                log.exception("request %s (%s) failed", _named(f), f.request_type)
            self._finish(f, error=_error(exc))
            return
        self.checkpointer.saves.submit(f.model_id or request["model_id"], (f, pending),
                                       lambda: self.checkpointer.write(pending))

    def _store_finished_saves(self) -> int:
        """The futures of saves whose files are completely written (or failed) complete now, in one batch."""
        done = []
        for (f, pending), size, error in self.checkpointer.saves.finished():
            try:
                result = self.checkpointer.end_save(pending, size, error)
            except Exception as exc:  # noqa: BLE001
                if f.request_type == "save_weights_for_sampler":
                    try:  # not saved: its path must not sample weights that were never listed
                        self.checkpointer.remove_snapshot(str(pending.path))
                    except ConflictError:
                        pass
                done.append((f, None, _error(exc)))
                continue
            if f.request_type != "save_weights_for_sampler":
                result = {**result, "type": f.request_type}
            done.append((f, result, None))
        if done:
            self._finish_many(done)
        return len(done)
