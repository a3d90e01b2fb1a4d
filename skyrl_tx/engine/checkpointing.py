"""Checkpointer: the engine's save and load operations (backend state ↔ CheckpointStore, rows in the DB).

A checkpoint row is "writing" while its files are written and becomes "ready" (listed) only after the
store has published the complete directory; a failed save leaves it "failed" and never listed. Saving
reads the model's state without changing it, so a failed save leaves training unaffected.

A save has three parts so the slow one runs off the engine thread: begin_save (engine thread: host copies of
the state, row claimed as "writing"), write (any thread: serialise and publish; no backend, no database) and
end_save (engine thread: the row becomes "ready" or "failed"). Full fine-tuning weights are written in the
model's dtype, tensor by tensor (checkpoints/tensor_files.py).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from skyrl_tx.checkpoints import formats
from skyrl_tx.checkpoints.catalog import ready_checkpoint
from skyrl_tx.checkpoints.formats import ModelMeta
from skyrl_tx.checkpoints.paths import TinkerPath
from skyrl_tx.checkpoints.store import CheckpointStore
from skyrl_tx.engine import executor
from skyrl_tx.engine.background_saves import BackgroundSaves
from skyrl_tx.engine.snapshot_memory import DEFAULT_SNAPSHOT_MEMORY_MB, SnapshotMemory
from skyrl_tx.db.models import CheckpointRecord, CheckpointStatus, FutureRecord, FutureStatus, ModelRecord
from skyrl_tx.errors import ConflictError, InvalidArgumentError, NotFoundError

log = logging.getLogger("skyrl_tx.engine")


def model_meta(model: ModelRecord, optimizer_step: int = 0) -> ModelMeta:
    lora = model.lora_config or {}
    return ModelMeta(base_model=model.base_model, lora_rank=model.lora_rank, lora_alpha=executor.LORA_ALPHA,
                     train_attn=bool(lora.get("train_attn", True)), train_mlp=bool(lora.get("train_mlp", True)),
                     train_unembed=bool(lora.get("train_unembed", True)), seed=lora.get("seed"),
                     optimizer_step=optimizer_step, optimizer=lora.get("optimizer", "adamw"))


@dataclass
class PendingSave:
    """A save between begin_save and end_save: the files hold private host copies of the saved state."""

    model_id: str
    path: TinkerPath
    record_id: int
    files: dict[str, formats.FileData]
    overwrite: bool


class Checkpointer:
    """Used only from the engine thread (it calls the backend), except `write`, which the save worker runs, and
    `expire`, which the engine's sweep thread runs (database and store only; engine/runner.py run_sweeps)."""

    def __init__(self, backend: Any, store: CheckpointStore, sessions: sessionmaker[Session], model_dir: Path):
        self.backend = backend
        self.store = store
        self.sessions = sessions
        self.model_dir = Path(model_dir)
        self.saves = BackgroundSaves()
        self.snapshot_memory = SnapshotMemory(backend, self._snapshot_budget(), self.model_dtype())
        self._full_models: dict[str, bool] = {}  # model id → full fine-tuning (lora_rank 0)

    def _snapshot_budget(self) -> int:
        """snapshot_memory_mb, or (0) what the device has left after the memory plan's peak (plan/capacity.py)."""
        settings = getattr(self.backend, "settings", None)
        budget_mb = getattr(settings, "snapshot_memory_mb", 0)
        if budget_mb:
            return budget_mb << 20
        config = getattr(self.backend, "decoder_config", None)
        if settings is None or config is None:
            return DEFAULT_SNAPSHOT_MEMORY_MB << 20
        from skyrl_tx.plan.capacity import snapshot_budget_bytes

        return snapshot_budget_bytes(config, settings, default=DEFAULT_SNAPSHOT_MEMORY_MB << 20)

    # ---- saving -----------------------------------------------------------------------------------
    def save(self, request: dict[str, Any]) -> dict[str, Any]:
        """The whole save on the calling thread. request: {model_id, path (tinker://...), overwrite?,
        ttl_seconds?, user_metadata?}."""
        pending = self.begin_save(request)
        try:
            size = self.write(pending)
        except BaseException as exc:
            self.end_save(pending, None, exc)
            raise
        return self.end_save(pending, size, None)

    def begin_save(self, request: dict[str, Any]) -> PendingSave:
        """Engine thread: copies the model's state to host memory and claims the checkpoint row ("writing").
        After it returns, the model may change: the save writes the copies."""
        path = TinkerPath.parse(request["path"])
        model_id = request["model_id"]
        with self.sessions() as db:
            model = db.get(ModelRecord, model_id)
            if model is None:
                raise NotFoundError(f"save: model {model_id!r} not found")
            meta = model_meta(model)
        files, meta = self._files(path.kind, model_id, meta)
        record_id = self._begin(path, meta, request)
        return PendingSave(model_id, path, record_id, files, bool(request.get("overwrite")))

    def write(self, pending: PendingSave) -> int:
        """Any thread: serialises and publishes the files (complete or not at all). Returns the bytes written."""
        return self.store.publish(self.store.location(pending.path), pending.files, overwrite=pending.overwrite)

    def end_save(self, pending: PendingSave, size: int | None, error: BaseException | None) -> dict[str, Any]:
        """Engine thread: lists the checkpoint (row "ready") once written, or marks it "failed" and raises."""
        pending.files.clear()  # the host copies are no longer needed
        with self.sessions.begin() as db:
            row = db.get(CheckpointRecord, pending.record_id)
            if error is not None:
                row.status = CheckpointStatus.FAILED.value
            else:
                row.status, row.size_bytes = CheckpointStatus.READY.value, size
        if error is not None:
            log.warning("saving checkpoint %s failed: %s", pending.path, error)
            raise error
        log.info("saved checkpoint %s (%d bytes)", pending.path, size)
        return {"path": str(pending.path)}

    def _files(self, kind: str, model_id: str, meta: ModelMeta) -> tuple[dict[str, formats.FileData], ModelMeta]:
        state = self.backend.trainable_state(model_id)  # float32 CPU copies: PEFT names or HF names
        dtype = self.model_dtype()  # full fine-tuning weights are saved in the model's dtype, not upcast
        if kind == "weights":
            optimizer = self.backend.optimizer_state(model_id)
            meta = dataclasses.replace(meta, optimizer_step=int(optimizer.step))
            files = formats.trainable_files(meta, state, dtype) | formats.optimizer_files(optimizer)
        elif meta.is_lora:  # sampler / external: what PEFT loads as is
            files = formats.adapter_files(meta, state)
        else:
            files = formats.hf_model_files(self.model_dir, state, dtype)
        files[formats.STATE_FILE] = formats.json_bytes(meta.to_json())
        return files, meta

    def model_dtype(self) -> Any:
        """The torch dtype the backend computes in (its BackendSettings.dtype; float32 if it has none)."""
        import torch

        return getattr(torch, getattr(getattr(self.backend, "settings", None), "dtype", "float32"))

    def _begin(self, path: TinkerPath, meta: ModelMeta, request: dict[str, Any]) -> int:
        """Claims the (model, kind, name) row as "writing"; an existing ready one needs overwrite."""
        ttl = request.get("ttl_seconds")
        expires_at = datetime.now(timezone.utc) + timedelta(seconds=int(ttl)) if ttl else None
        with self.sessions.begin() as db:
            row = db.scalar(select(CheckpointRecord).where(CheckpointRecord.tinker_path == str(path)))
            if row is not None and row.status == CheckpointStatus.READY.value and not request.get("overwrite"):
                raise ConflictError(f"save: checkpoint {path} already exists; save with overwrite=True or pick "
                                    "another name")
            if row is None:
                row = CheckpointRecord(model_id=path.training_run_id, kind=path.kind, name=path.name,
                                       tinker_path=str(path), storage_uri=self.store.location(path))
                db.add(row)
            row.status, row.created_at, row.expires_at = CheckpointStatus.WRITING.value, datetime.now(timezone.utc), expires_at
            row.user_metadata, row.model_meta = request.get("user_metadata"), meta.to_json()
            row.storage_uri = self.store.location(path)
            db.flush()
            return row.id

    # ---- loading ----------------------------------------------------------------------------------
    def load_into(self, model_id: str, path_text: str, with_optimizer: bool, fresh: bool = False) -> dict[str, Any]:
        """Restores a training checkpoint into `model_id` (weights, and optimizer state if asked)."""
        path = TinkerPath.parse(path_text, "load_weights: path")
        if path.kind != "weights":
            raise InvalidArgumentError(f"load_weights: {path} is a {path.checkpoint_type} checkpoint; load a "
                                       "training checkpoint (tinker://<run>/weights/<name>, from save_state)")
        with self.sessions() as db:
            record = ready_checkpoint(db, path, "load_weights")
            location = record.storage_uri
            if not fresh:
                self._refuse_if_used(db, model_id)
        read = lambda name: self.store.read(location, name)  # noqa: E731
        meta = formats.read_meta(read)
        saved = formats.read_optimizer(read) if with_optimizer else None
        if saved is not None and saved["kind"] != self.backend.optimizer_kind(model_id):  # before any change
            raise InvalidArgumentError(f"load_weights: {path} holds {saved['kind']} optimizer state, but model "
                                       f"{model_id} uses {self.backend.optimizer_kind(model_id)}; load the weights "
                                       "only, or create the model with that optimizer")
        self.backend.set_trainable_state(model_id, formats.read_weights(read, meta))
        if saved is not None:
            self.backend.restore_optimizer(model_id, saved)
        return {"path": str(path), "model_id": model_id, "type": "load_weights"}

    def _refuse_if_used(self, db: Session, model_id: str) -> None:
        used = db.scalar(select(FutureRecord.id).where(
            FutureRecord.model_id == model_id, FutureRecord.status == FutureStatus.COMPLETED.value,
            FutureRecord.request_type.in_(("forward_backward", "optim_step", "load_weights"))).limit(1))
        if used is not None:
            raise ConflictError(f"load_weights: model {model_id} has already trained; loading over its state is "
                                "refused. Create a new training client from the checkpoint "
                                "(ServiceClient.create_training_client_from_state[_with_optimizer]) instead")

    # ---- sampler snapshots --------------------------------------------------------------------------
    def snapshot(self, model_id: str, snapshot_id: str) -> None:
        """Freezes the model's current weights as `snapshot_id`. A full fine-tuning model's frozen copy counts
        against the snapshot memory budget (engine/snapshot_memory.py); an adapter's factors live in host
        memory and its device slots are the backend's (max_resident_snapshots)."""
        if not self._is_full(model_id):
            self.backend.snapshot(model_id, snapshot_id)
            return
        # An ephemeral one's spill reads only the tensors no earlier spill of the model holds (snapshot_memory.py).
        self.snapshot_memory.freeze(model_id, snapshot_id)

    def has_snapshot(self, snapshot_id: str) -> bool:
        """In memory, or evicted to disk and loaded back when sampled."""
        return self.backend.has_snapshot(snapshot_id) or self.snapshot_memory.holds(snapshot_id)

    def remove_snapshot(self, snapshot_id: str) -> None:
        """Forgets a snapshot (memory and spill file). ConflictError while it serves running samples."""
        if self.snapshot_memory.holds(snapshot_id):
            self.snapshot_memory.release(snapshot_id)
        elif self.backend.has_snapshot(snapshot_id):
            self.backend.remove_snapshot(snapshot_id)

    def _is_full(self, model_id: str) -> bool:
        full = self._full_models.get(model_id)
        if full is None:
            with self.sessions() as db:
                model = db.get(ModelRecord, model_id)
                if model is None:
                    raise NotFoundError(f"snapshot: model {model_id!r} not found")
                full = self._full_models[model_id] = model.lora_rank == 0
        return full

    def ensure_snapshot(self, snapshot_id: str) -> None:
        """Makes a snapshot sampleable: a full one evicted from memory loads back, a sampler checkpoint is
        loaded from the store (after a restart, or saved by another server process)."""
        if not snapshot_id:
            return
        if self.backend.has_snapshot(snapshot_id):
            self.snapshot_memory.touch(snapshot_id)
            return
        if self.snapshot_memory.ensure(snapshot_id) or not snapshot_id.startswith("tinker://"):
            return
        path = TinkerPath.parse(snapshot_id, "sample: model_path")
        with self.sessions() as db:
            location = ready_checkpoint(db, path, "sample").storage_uri
        read = lambda name: self.store.read(location, name)  # noqa: E731
        meta = formats.read_meta(read)
        weights = formats.read_weights(read, meta)
        if meta.is_lora:
            self.backend.load_snapshot(snapshot_id, weights, rank=meta.lora_rank, alpha=meta.lora_alpha,
                                       train_attn=meta.train_attn, train_mlp=meta.train_mlp,
                                       train_unembed=meta.train_unembed)
        else:
            self.snapshot_memory.load(snapshot_id, weights)
        log.info("loaded sampler checkpoint %s from %s", snapshot_id, location)

    # ---- housekeeping -----------------------------------------------------------------------------
    def recover(self) -> None:
        """At engine start: saves that were writing when the engine died are failed, their files removed."""
        with self.sessions.begin() as db:
            for row in db.scalars(select(CheckpointRecord).where(
                    CheckpointRecord.status == CheckpointStatus.WRITING.value)):
                row.status = CheckpointStatus.FAILED.value
                # The engine may have died after the directory was published but before the row said so:
                # unlisted, it would only make the save that runs again find its name taken.
                self.store.delete(row.storage_uri)
                log.info("checkpoint %s was interrupted while writing; it is not listed", row.tinker_path)
        removed = self.store.sweep_partials()
        if removed:
            log.info("removed %d partial checkpoint directories", removed)

    def expire(self) -> list[str]:
        """Deletes checkpoints past their ttl. Returns their paths."""
        now = datetime.now(timezone.utc)
        expired = []
        with self.sessions.begin() as db:
            for row in db.scalars(select(CheckpointRecord).where(
                    CheckpointRecord.status == CheckpointStatus.READY.value, CheckpointRecord.expires_at.is_not(None),
                    CheckpointRecord.expires_at < now)):
                self.store.delete(row.storage_uri)
                row.status = CheckpointStatus.DELETED.value
                expired.append(row.tinker_path)
        for p in expired:
            log.info("checkpoint %s expired and was deleted", p)
        return expired
