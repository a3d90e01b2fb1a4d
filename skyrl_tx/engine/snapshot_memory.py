"""SnapshotMemory: full fine-tuning sampler snapshots held within a byte budget, least recently used to disk.

A full fine-tuning snapshot is a frozen copy of the whole model on the device (with, once sampled, its own
generator and KV cache): up to KEEP_PER_MODEL ephemeral + KEEP_PER_MODEL named ones per model would not fit.
The frozen copies in memory never add up to more than the budget (backend-config `snapshot_memory_mb`):
making room evicts the least recently sampled snapshot that no running sample uses, and sampling an evicted
one loads it again. A named snapshot reloads from its sampler checkpoint (Checkpointer.ensure_snapshot); an
ephemeral one from the spill file written, on a background thread and in the model's dtype, when it was taken
(the backend cannot hand a frozen copy back, so the only moment to save it is its creation).
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import shutil
import tempfile
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from skyrl_tx.checkpoints.tensor_files import TensorFile
from skyrl_tx.errors import ConflictError, NotFoundError, ResourceExhaustedError

log = logging.getLogger("skyrl_tx.engine")

DEFAULT_SNAPSHOT_MEMORY_MB = 8192


def is_named(snapshot_id: str) -> bool:
    """Named snapshots are sampler checkpoints (tinker:// paths): they reload from the checkpoint store."""
    return snapshot_id.startswith("tinker://")


class SnapshotMemory:
    """Engine thread only (the spill writes run on their own worker and touch no backend)."""

    def __init__(self, backend: Any, budget_bytes: int, dtype: Any):
        self.backend = backend
        self.budget = budget_bytes
        self.dtype = dtype  # the frozen copies' dtype (the model's): what a snapshot costs per weight
        self._resident: OrderedDict[str, int] = OrderedDict()  # snapshot id → bytes; least recently used first
        self._spilled: dict[str, Future[Path]] = {}  # ephemeral snapshot id → its spill file (maybe still writing)
        self._dir: Path | None = None
        self._full_size: int | None = None  # bytes of one frozen full model
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="skyrl-tx-snapshot-spill")

    @property
    def resident_bytes(self) -> int:
        return sum(self._resident.values())

    def holds(self, snapshot_id: str) -> bool:
        """Whether the snapshot is in memory or can be loaded back from its spill file."""
        return snapshot_id in self._resident or snapshot_id in self._spilled

    def size_of(self, weights: dict[str, Any]) -> int:
        return sum(t.numel() for t in weights.values()) * self.dtype.itemsize

    # ---- engine thread ---------------------------------------------------------------------------
    def freeze(self, model_id: str, snapshot_id: str, state: dict[str, Any] | None) -> None:
        """A new snapshot of full model `model_id`. `state`, a host copy of its weights right now, is needed
        only by an ephemeral snapshot (a named one reloads from its checkpoint). It is made resident if the
        budget has room (after evicting others), else it waits on disk for its first sample."""
        if not is_named(snapshot_id):  # only this copy can ever bring an ephemeral snapshot back
            assert state is not None
            self._spilled[snapshot_id] = self._writer.submit(self._spill, snapshot_id, state)
        if state is not None:
            self._full_size = self.size_of(state)
        elif self._full_size is None:  # every full model is a copy of the base: one size for all
            self._full_size = self.size_of(self.backend.trainable_state(model_id))
        size = self._full_size
        if self._make_room(size, keep=snapshot_id):
            self.backend.snapshot(model_id, snapshot_id)
            self._resident[snapshot_id] = size
        else:
            log.info("snapshot %s starts on disk: %d bytes of frozen copies serve running samples (budget %d)",
                     snapshot_id, self.resident_bytes, self.budget)

    def touch(self, snapshot_id: str) -> None:
        if snapshot_id in self._resident:
            self._resident.move_to_end(snapshot_id)

    def ensure(self, snapshot_id: str) -> bool:
        """Loads a spilled ephemeral snapshot back if needed; False if this is not one."""
        if snapshot_id in self._resident:
            self._resident.move_to_end(snapshot_id)
            return True
        spill = self._spilled.get(snapshot_id)
        if spill is None:
            return False
        from safetensors.torch import load_file

        # Cloned out of the file's mapping into the allocator's aligned memory, as the copy it replaces was:
        # CPU matmul kernels may round differently on differently aligned weights.
        weights = {name: t.clone() for name, t in load_file(str(spill.result())).items()}  # waits for its write
        self.load(snapshot_id, weights)
        return True

    def load(self, snapshot_id: str, weights: dict[str, Any]) -> None:
        """Makes `weights` (HF names) the resident frozen snapshot `snapshot_id`, evicting others for room."""
        size = self.size_of(weights)
        if not self._make_room(size, keep=snapshot_id):
            if size > self.budget:
                raise ResourceExhaustedError(
                    f"sample: snapshot {snapshot_id} needs {size >> 20} MiB, more than the snapshot budget "
                    f"({self.budget >> 20} MiB); raise the backend-config key snapshot_memory_mb")
            raise ResourceExhaustedError(
                f"sample: every snapshot in memory ({self.resident_bytes >> 20} MiB of {self.budget >> 20} MiB) "
                f"serves running samples; retry once they finish, or raise the backend-config key snapshot_memory_mb")
        self.backend.load_frozen_model(snapshot_id, weights)
        self._resident[snapshot_id] = size
        log.info("snapshot %s loaded back into memory (%d of %d bytes used)", snapshot_id, self.resident_bytes,
                 self.budget)

    def release(self, snapshot_id: str) -> None:
        """Forgets a snapshot for good (retention, overwrite). ConflictError while it serves running samples."""
        if snapshot_id in self._resident:
            self.backend.remove_snapshot(snapshot_id)
            del self._resident[snapshot_id]
        spill = self._spilled.pop(snapshot_id, None)
        if spill is not None:
            spill.add_done_callback(_remove_file)

    def close(self) -> None:
        self._writer.shutdown(wait=True)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    def _make_room(self, size: int, keep: str) -> bool:
        """Evicts least recently used snapshots until `size` more bytes fit; False if they cannot."""
        if size > self.budget:
            return False
        for victim in list(self._resident):
            if self.resident_bytes + size <= self.budget:
                break
            if victim == keep:
                continue
            spill = self._spilled.get(victim)
            if spill is not None and spill.exception() is not None:
                continue  # its spill write failed: evicted, it could never come back
            try:
                self.backend.remove_snapshot(victim)
            except ConflictError:  # serving running samples
                continue
            except NotFoundError:
                pass
            del self._resident[victim]
            log.info("snapshot %s evicted from memory to %s", victim, "disk" if spill else "its checkpoint")
        return self.resident_bytes + size <= self.budget

    # ---- spill worker ----------------------------------------------------------------------------
    def _spill(self, snapshot_id: str, state: dict[str, Any]) -> Path:
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="skyrl-tx-snapshots-"))
            atexit.register(shutil.rmtree, self._dir, True)  # spill files never outlive the engine
        path = self._dir / f"{hashlib.sha256(snapshot_id.encode()).hexdigest()[:32]}.safetensors"
        with open(path, "wb") as out:
            TensorFile(state, cast_to=self.dtype).write_to(out)
        return path


def _remove_file(spill: Future[Path]) -> None:
    if spill.exception() is None:
        spill.result().unlink(missing_ok=True)
