"""SnapshotMemory: full fine-tuning sampler snapshots held within a byte budget, least recently used to disk.

A full fine-tuning snapshot is a frozen copy of the whole model on the device (with, once sampled, its own
generator and KV cache): up to KEEP_PER_MODEL ephemeral + KEEP_PER_MODEL named ones per model would not fit.
The frozen copies in memory never add up to more than the budget (backend-config `snapshot_memory_mb`):
making room evicts the least recently sampled snapshot that no running sample uses, and sampling an evicted
one loads it again. A named snapshot reloads from its sampler checkpoint (Checkpointer.ensure_snapshot); an
ephemeral one from the spill files written, on a background thread and in the model's dtype, when it was taken
(the only moment its weights are sure to be at hand).

Versions share what did not change. Each tensor of a full model has a stamp (the backend's weight_stamps: the
model's life and the tensor's version counter, bumped by every in-place write), so without hashing any bytes:
- in memory, the backend's frozen copy of a snapshot shares the storage of every tensor whose stamp equals the
  one it had in a frozen copy still held (two snapshots with no optim_step between share everything; after a
  step, the tensors it did not write stay shared), and the budget counts each storage once (frozen_bytes);
- on disk, a snapshot's spill writes only the tensors whose stamp no earlier spill of the model wrote; the
  others are read back from the earlier file, which lives while any snapshot refers to it.
"""

from __future__ import annotations

import atexit
import hashlib
import itertools
import logging
import shutil
import tempfile
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from skyrl_tx.checkpoints.tensor_files import TensorFile
from skyrl_tx.errors import ConflictError, NotFoundError, ResourceExhaustedError

log = logging.getLogger("skyrl_tx.engine")

DEFAULT_SNAPSHOT_MEMORY_MB = 8192
_file_numbers = itertools.count()


def is_named(snapshot_id: str) -> bool:
    """Named snapshots are sampler checkpoints (tinker:// paths): they reload from the checkpoint store."""
    return snapshot_id.startswith("tinker://")


@dataclass(eq=False)
class SpillFile:
    """One spill write: some tensors of one version of a model. Removed when no snapshot refers to it."""

    written: Future[Path]
    names: frozenset[str]
    bytes: int
    users: int = 0


@dataclass
class Spill:
    """An ephemeral snapshot on disk: where each of its tensors is (a file of its own spill or an earlier one)."""

    files: dict[str, SpillFile] = field(default_factory=dict)  # tensor name → the file holding its bytes

    def failed(self) -> bool:
        """Waits for its writes; True if any failed (it could never be loaded back)."""
        return any(f.written.exception() is not None for f in set(self.files.values()))


class SnapshotMemory:
    """Engine thread only (the spill writes run on their own worker and touch no backend)."""

    def __init__(self, backend: Any, budget_bytes: int, dtype: Any):
        self.backend = backend
        self.budget = budget_bytes
        self.dtype = dtype  # the frozen copies' dtype (the model's): what a snapshot costs per weight
        self._resident: OrderedDict[str, int] = OrderedDict()  # snapshot id → bytes it added; least recently used first
        self._spilled: dict[str, Spill] = {}  # ephemeral snapshot id → its tensors on disk (maybe still writing)
        self._latest: dict[str, dict[str, tuple[Any, SpillFile]]] = {}  # model id → name → (stamp, file holding it)
        self._dir: Path | None = None
        self._full_size: int | None = None  # bytes of one frozen full model (backends without snapshot_cost)
        self.spilled_bytes = 0  # bytes written to spill files so far (bench snapshots reports it)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="skyrl-tx-snapshot-spill")

    @property
    def resident_bytes(self) -> int:
        """Bytes of the frozen copies in memory, each shared tensor counted once."""
        frozen_bytes = getattr(self.backend, "frozen_bytes", None)
        return int(frozen_bytes()) if frozen_bytes is not None else sum(self._resident.values())

    def holds(self, snapshot_id: str) -> bool:
        """Whether the snapshot is in memory or can be loaded back from its spill file."""
        return snapshot_id in self._resident or snapshot_id in self._spilled

    def size_of(self, weights: dict[str, Any]) -> int:
        return sum(t.numel() for t in weights.values()) * self.dtype.itemsize

    # ---- engine thread ---------------------------------------------------------------------------
    def freeze(self, model_id: str, snapshot_id: str, state: dict[str, Any] | None = None) -> None:
        """A new snapshot of full model `model_id`. An ephemeral one is spilled to disk (the tensors no earlier
        spill of the model holds, read from the backend now; or `state`, a host copy of all its weights, when
        given). It is made resident if the budget has room (after evicting others), else it waits on disk for
        its first sample (a named one reloads from its checkpoint)."""
        if not is_named(snapshot_id):  # only this copy can ever bring an ephemeral snapshot back
            self._spilled[snapshot_id] = self._spill(model_id, state)
        if state is not None:
            self._full_size = self.size_of(state)
        if self._make_room(lambda: self._cost(model_id), keep=snapshot_id):
            added = self._cost(model_id)
            self.backend.snapshot(model_id, snapshot_id)
            self._resident[snapshot_id] = added
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
        from safetensors import safe_open

        weights: dict[str, Any] = {}
        for file in set(spill.files.values()):
            wanted = [name for name, f in spill.files.items() if f is file]
            with safe_open(str(file.written.result()), framework="pt") as f:  # waits for its write
                # Cloned out of the file's mapping into the allocator's aligned memory, as the copy it replaces
                # was: CPU matmul kernels may round differently on differently aligned weights.
                weights.update({name: f.get_tensor(name).clone() for name in wanted})
        self.load(snapshot_id, weights)
        return True

    def load(self, snapshot_id: str, weights: dict[str, Any]) -> None:
        """Makes `weights` (HF names) the resident frozen snapshot `snapshot_id`, evicting others for room."""
        size = self.size_of(weights)
        if not self._make_room(lambda: size, keep=snapshot_id):
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
            for file in set(spill.files.values()):
                self._drop_user(file)

    def close(self) -> None:
        self._writer.shutdown(wait=True)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    def _cost(self, model_id: str) -> int:
        """Bytes a snapshot of the model adds now: the tensors no frozen copy in memory shares."""
        cost = getattr(self.backend, "snapshot_cost", None)
        if cost is not None:
            return int(cost(model_id))
        if self._full_size is None:  # every full model is a copy of the base: one size for all
            self._full_size = self.size_of(self.backend.trainable_state(model_id))
        return self._full_size

    def _make_room(self, size_now: Any, keep: str) -> bool:
        """Evicts least recently used snapshots until what the new one adds (`size_now()`, asked again after each
        eviction: evicting a copy whose tensors the new one would share makes it cost more) fits; False if it
        cannot."""
        if size_now() > self.budget:
            return False
        for victim in list(self._resident):
            if self.resident_bytes + size_now() <= self.budget:
                break
            if victim == keep:
                continue
            spill = self._spilled.get(victim)
            if spill is not None and spill.failed():
                continue  # its spill write failed: evicted, it could never come back
            try:
                self.backend.remove_snapshot(victim)
            except ConflictError:  # serving running samples
                continue
            except NotFoundError:
                pass
            del self._resident[victim]
            log.info("snapshot %s evicted from memory to %s", victim, "disk" if spill else "its checkpoint")
        return self.resident_bytes + size_now() <= self.budget

    # ---- spill files -----------------------------------------------------------------------------
    def _spill(self, model_id: str, state: dict[str, Any] | None) -> Spill:
        """Engine thread: the tensors to write are read from the backend now (only those whose stamp no earlier
        spill of the model wrote); the write runs on the worker."""
        stamps_of = getattr(self.backend, "weight_stamps", None)
        stamps = dict(stamps_of(model_id)) if stamps_of is not None and state is None else None
        latest = self._latest.setdefault(model_id, {})
        if stamps is None:  # no stamps (or a host copy given): nothing is known to be unchanged
            latest.clear()
            tensors = state if state is not None else self.backend.trainable_state(model_id)
            stamps = {name: object() for name in tensors}  # stamps no later spill can match
        else:
            # A file whose write is known to have failed is no source: the tensor is written again (else every later
            # snapshot of unchanged weights would refer to it and could never be loaded back, nor evicted).
            changed = {name for name, stamp in stamps.items()
                       if name not in latest or latest[name][0] != stamp or _failed(latest[name][1])}
            tensors = self.backend.trainable_state(model_id, names=changed, model_dtype=True) if changed else {}
        spill = Spill()
        if tensors:
            file = SpillFile(self._writer.submit(self._write, tensors), frozenset(tensors), self.size_of(tensors))
            self.spilled_bytes += file.bytes
            for name in tensors:
                latest[name] = (stamps[name], file)
        for name in stamps:
            spill.files[name] = latest[name][1]
        for file in set(spill.files.values()):
            file.users += 1
        return spill

    def _drop_user(self, file: SpillFile) -> None:
        file.users -= 1
        if file.users > 0:
            return
        for latest in self._latest.values():  # no later spill may refer to a removed file
            for name in [n for n, (_, f) in latest.items() if f is file]:
                del latest[name]
        file.written.add_done_callback(_remove_file)

    def _write(self, tensors: dict[str, Any]) -> Path:  # the spill worker
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="skyrl-tx-snapshots-"))
            atexit.register(shutil.rmtree, self._dir, True)  # spill files never outlive the engine
        name = hashlib.sha256(f"{id(self)}:{next(_file_numbers)}".encode()).hexdigest()[:32]
        path = self._dir / f"{name}.safetensors"
        with open(path, "wb") as out:
            TensorFile(tensors, cast_to=self.dtype).write_to(out)
        return path


def _failed(file: SpillFile) -> bool:
    """Whether the file's write has ended in an error (without waiting for one still running)."""
    return file.written.done() and file.written.exception() is not None


def _remove_file(written: Future[Path]) -> None:
    if written.exception() is None:
        written.result().unlink(missing_ok=True)
