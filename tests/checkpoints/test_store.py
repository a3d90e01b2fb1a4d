"""CheckpointStore: atomic publish and copy, clear storage errors, partial sweeps — locally and on S3 (moto_server)."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator, Mapping

import pytest
from s3_server import make_bucket, moto_s3, s3_options

from skyrl_tx.checkpoints.paths import TinkerPath
from skyrl_tx.checkpoints.store import PARTIAL_MARKER, CheckpointStore, StorageError
from skyrl_tx.errors import NotFoundError

PATH = TinkerPath("sess:train:0", "weights", "step_1")
COPY = TinkerPath("other:train:0", "weights", "step_1")
FILES = {"a.bin": b"x" * 1000, "nested/b.json": b"{}"}


class FailingFiles(Mapping[str, bytes]):
    """Yields one file, then fails like a full disk: a save interrupted half-way."""

    def __getitem__(self, key: str) -> bytes:
        return FILES[key]

    def __len__(self) -> int:
        return 2

    def __iter__(self) -> Iterator[str]:
        return iter(FILES)

    def items(self):
        yield "a.bin", FILES["a.bin"]
        raise OSError(errno.ENOSPC, "No space left on device")


def roundtrip(store: CheckpointStore) -> None:
    location = store.location(PATH)
    assert store.publish(location, FILES) == 1002
    assert store.files(location) == {"a.bin": 1000, "nested/b.json": 2}
    assert store.read(location, "a.bin") == FILES["a.bin"]
    assert b"".join(store.open_stream(location, "a.bin", chunk_bytes=300)) == FILES["a.bin"]
    with pytest.raises(StorageError, match="already exists"):
        store.publish(location, {"a.bin": b"new"})
    store.publish(location, {"a.bin": b"new"}, overwrite=True)
    assert store.files(location) == {"a.bin": 3}  # the old directory is replaced, not merged
    store.delete(location)
    assert store.files(location) == {}


def copy_roundtrip(store: CheckpointStore) -> None:
    source, target = store.location(PATH), store.location(COPY)
    store.publish(source, FILES)
    assert store.publish_copy(source, target) == 1002
    assert store.files(target) == store.files(source)
    assert store.read(target, "nested/b.json") == FILES["nested/b.json"]
    with pytest.raises(StorageError, match="already exists"):
        store.publish_copy(source, target)
    store.delete(source)  # the copy has files of its own
    assert store.read(target, "a.bin") == FILES["a.bin"]
    with pytest.raises(NotFoundError, match="missing"):
        store.publish_copy(source, store.location(TinkerPath("third:train:0", "weights", "step_1")))
    assert store.files(store.location(TinkerPath("third:train:0", "weights", "step_1"))) == {}


def test_local_roundtrip(tmp_path) -> None:
    roundtrip(CheckpointStore(str(tmp_path / "ckpt")))


def test_local_copy(tmp_path) -> None:
    copy_roundtrip(CheckpointStore(str(tmp_path / "ckpt")))


def test_interrupted_copy_leaves_nothing(tmp_path, monkeypatch) -> None:
    store = CheckpointStore(str(tmp_path / "ckpt"))
    store.publish(store.location(PATH), FILES)
    copy_file, copied = store.fs.copy, []

    def full_after_one(src: str, dst: str, **kwargs) -> None:  # the disk fills up after the first file
        if copied:
            raise OSError(errno.ENOSPC, "No space left on device")
        copied.append(src)
        copy_file(src, dst, **kwargs)

    monkeypatch.setattr(store.fs, "copy", full_after_one)
    with pytest.raises(StorageError, match="full"):
        store.publish_copy(store.location(PATH), store.location(COPY))
    assert copied and store.files(store.location(COPY)) == {}
    assert [p for p in (tmp_path / "ckpt").rglob("*") if PARTIAL_MARKER in p.name] == []


def test_interrupted_publish_leaves_nothing(tmp_path) -> None:
    store = CheckpointStore(str(tmp_path / "ckpt"))
    location = store.location(PATH)
    with pytest.raises(StorageError, match="full"):
        store.publish(location, FailingFiles())
    assert store.files(location) == {}
    leftovers = [p for p in (tmp_path / "ckpt").rglob("*") if PARTIAL_MARKER in p.name]
    assert leftovers == []


def test_sweep_removes_partials_of_a_dead_process(tmp_path) -> None:
    store = CheckpointStore(str(tmp_path / "ckpt"))
    partial = f"{store.location(PATH)}{PARTIAL_MARKER}deadbeef"
    os.makedirs(partial)
    (tmp_path / "ckpt" / "keep").mkdir()
    assert store.sweep_partials() == 1
    assert not os.path.exists(partial) and (tmp_path / "ckpt" / "keep").is_dir()


def test_unwritable_store_is_a_clear_error(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    store = CheckpointStore.__new__(CheckpointStore)  # skip the makedirs of __init__ to reach publish
    CheckpointStore.__init__(store, str(tmp_path / "ok"))
    store.root = str(blocker)  # every checkpoint directory would live under a regular file
    with pytest.raises(StorageError, match="checkpoint store"):
        store.publish(store.location(PATH), FILES)


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    with moto_s3() as url:
        yield url


def test_s3_roundtrip(s3_endpoint) -> None:
    make_bucket(s3_endpoint, "store-test")
    roundtrip(CheckpointStore("s3://store-test/ckpts", s3_options(s3_endpoint)))


def test_s3_copy(s3_endpoint) -> None:
    make_bucket(s3_endpoint, "store-copy")
    copy_roundtrip(CheckpointStore("s3://store-copy/ckpts", s3_options(s3_endpoint)))


def test_s3_interrupted_publish_leaves_nothing(s3_endpoint) -> None:
    make_bucket(s3_endpoint, "store-interrupt")
    store = CheckpointStore("s3://store-interrupt/ckpts", s3_options(s3_endpoint))
    with pytest.raises(StorageError):
        store.publish(store.location(PATH), FailingFiles())
    assert store.files(store.location(PATH)) == {}
    assert store.sweep_partials() == 0
