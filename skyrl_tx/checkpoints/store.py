"""CheckpointStore: checkpoint directories under a local path or any fsspec URL, published atomically."""

from __future__ import annotations

import errno
import logging
import os
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from skyrl_tx.checkpoints.paths import TinkerPath
from skyrl_tx.checkpoints.tensor_files import TensorFile
from skyrl_tx.errors import InternalError, NotFoundError

log = logging.getLogger("skyrl_tx.checkpoints")

PARTIAL_MARKER = ".partial-"  # directories being written; never referenced by the database


def default_checkpoints_base() -> str:
    """<data directory>/checkpoints (see skyrl_tx.db.session.default_data_dir)."""
    from skyrl_tx.db.session import default_data_dir

    return str(default_data_dir() / "checkpoints")


class StorageError(InternalError):
    """The store could not be written or read (full disk, no permission, unreachable bucket)."""


class CheckpointStore:
    """One directory per checkpoint: <base>/<run>/<kind>/<name>/<files>. The database decides what is
    listed; the store only guarantees that a published directory is complete."""

    def __init__(self, base_url: str, storage_options: Mapping[str, Any] | None = None):
        self.fs, root = fsspec.core.url_to_fs(base_url, **dict(storage_options or {}))
        self.root = root.rstrip("/")
        self.base_url = base_url
        self.is_local = isinstance(self.fs, LocalFileSystem)
        if self.is_local:
            os.makedirs(self.root, exist_ok=True)

    def location(self, path: TinkerPath) -> str:
        """The directory a checkpoint is published to (stored as CheckpointRecord.storage_uri)."""
        run = path.training_run_id.replace(":", "-").replace("/", "-")
        return f"{self.root}/{run}/{path.kind}/{path.name}"

    def publish(self, location: str, files: Mapping[str, bytes | TensorFile], overwrite: bool = False) -> int:
        """Writes every file under a temporary name, then moves the directory into place; returns the
        bytes written. On failure nothing is left at `location` (and the partial directory is removed).
        A TensorFile is streamed tensor by tensor (an object store uploads it in parts), never held whole."""
        partial = f"{location}{PARTIAL_MARKER}{uuid.uuid4().hex[:12]}"
        written = 0
        try:
            self.fs.makedirs(partial, exist_ok=True)
            for name, data in files.items():
                if "/" in name:
                    self.fs.makedirs(f"{partial}/{name.rsplit('/', 1)[0]}", exist_ok=True)
                with self.fs.open(f"{partial}/{name}", "wb") as out:
                    if isinstance(data, TensorFile):
                        written += data.write_to(out)
                    else:
                        out.write(data)
                        written += len(data)
            self._move_into_place(partial, location, list(files), overwrite)
        except BaseException as exc:
            self._remove_quietly(partial)
            if isinstance(exc, OSError):
                raise StorageError(_explain(exc, self.base_url)) from exc
            raise
        return written

    def publish_copy(self, source: str, location: str) -> int:
        """Copies the published checkpoint directory `source` to `location`, published as `publish` does (complete
        or not at all); returns the bytes copied. The store copies each file itself (a server-side copy on object
        stores), so no file is read into memory whole."""
        files = self.files(source)
        if not files:
            raise NotFoundError(f"checkpoint files are missing from {source} (deleted while being copied?)")
        partial = f"{location}{PARTIAL_MARKER}{uuid.uuid4().hex[:12]}"
        try:
            self.fs.makedirs(partial, exist_ok=True)
            for name in files:
                if "/" in name:
                    self.fs.makedirs(f"{partial}/{name.rsplit('/', 1)[0]}", exist_ok=True)
                self.fs.copy(f"{source}/{name}", f"{partial}/{name}")
            self._move_into_place(partial, location, list(files), overwrite=False)
        except BaseException as exc:
            self._remove_quietly(partial)
            if isinstance(exc, FileNotFoundError):
                raise NotFoundError(f"checkpoint file {exc.filename or ''} is missing from {source} (deleted while "
                                    "being copied?)") from exc
            if isinstance(exc, OSError):
                raise StorageError(_explain(exc, self.base_url)) from exc
            raise
        return sum(files.values())

    def _move_into_place(self, partial: str, location: str, names: list[str], overwrite: bool) -> None:
        if self.fs.exists(location):
            if not overwrite:
                raise FileExistsError(errno.EEXIST, "checkpoint exists", location)
            self.fs.rm(location, recursive=True)
        if self.is_local:
            os.rename(partial, location)  # atomic on one filesystem: readers see all files or none
        else:  # object stores have no rename: copy file by file; listed only once the DB says "ready"
            for name in names:
                self.fs.copy(f"{partial}/{name}", f"{location}/{name}")
            self.fs.rm(partial, recursive=True)

    def read(self, location: str, name: str) -> bytes:
        try:
            with self.fs.open(f"{location}/{name}", "rb") as f:
                return f.read()
        except FileNotFoundError as exc:
            raise NotFoundError(f"checkpoint file {name!r} is missing from {location} (deleted or never "
                                "completely written)") from exc
        except OSError as exc:
            raise StorageError(_explain(exc, self.base_url)) from exc

    def open_stream(self, location: str, name: str, chunk_bytes: int = 1 << 20) -> Iterator[bytes]:
        """The file's bytes in chunks, never read whole into memory (downloads)."""
        with self.fs.open(f"{location}/{name}", "rb") as f:
            while chunk := f.read(chunk_bytes):
                yield chunk

    def files(self, location: str) -> dict[str, int]:
        """File name (relative to the checkpoint directory) → size in bytes."""
        try:
            found = self.fs.find(location, detail=True)
        except FileNotFoundError:
            return {}
        prefix = location.rstrip("/") + "/"
        return {p.removeprefix(prefix): int(info.get("size") or 0) for p, info in found.items()
                if p.startswith(prefix)}

    def delete(self, location: str) -> None:
        try:
            if self.fs.exists(location):
                self.fs.rm(location, recursive=True)
        except OSError as exc:
            raise StorageError(_explain(exc, self.base_url)) from exc

    def sweep_partials(self) -> int:
        """Removes directories left by saves that died mid-write (run at engine start). Returns how many."""
        removed = 0
        try:
            candidates = self.fs.find(self.root, withdirs=True, maxdepth=3)
        except (FileNotFoundError, OSError):
            return 0
        for p in candidates:
            if PARTIAL_MARKER in p.rsplit("/", 1)[-1]:
                self._remove_quietly(p)
                removed += 1
        return removed

    def _remove_quietly(self, location: str) -> None:
        try:
            if self.fs.exists(location):
                self.fs.rm(location, recursive=True)
        except OSError:
            log.warning("could not remove partial checkpoint directory %s", location)


def _explain(exc: OSError, base_url: str) -> str:
    if exc.errno == errno.ENOSPC:
        return f"checkpoint store {base_url} is full (no space left on device); free space or use another --checkpoints-base"
    if exc.errno == errno.EEXIST:
        return f"checkpoint {exc.filename} already exists; save with overwrite=True or pick another name"
    if isinstance(exc, PermissionError) or exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"checkpoint store {base_url} is not writable ({exc.strerror or exc}); check --checkpoints-base"
    return f"checkpoint store {base_url} failed: {exc}; check --checkpoints-base"
