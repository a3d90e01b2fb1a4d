"""The models on a migrated database: each record type round-trips; constraints and foreign keys hold."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError, StatementError
from sqlalchemy.orm import Session, sessionmaker

from skyrl_tx.db import migrate
from skyrl_tx.db.models import (
    CheckpointRecord,
    CheckpointStatus,
    FutureRecord,
    FutureStatus,
    ModelRecord,
    ModelStatus,
    SamplingSessionRecord,
    SessionRecord,
    SessionStatus,
    request_hash,
)
from skyrl_tx.db.session import default_database_url, make_engine, make_session_factory, normalize_url


@pytest.fixture
def db(database_url: str) -> Iterator[sessionmaker[Session]]:
    migrate.upgrade(database_url)
    engine = make_engine(database_url)
    try:
        yield make_session_factory(engine)
    finally:
        engine.dispose()


def add_session_and_model(factory: sessionmaker[Session], model_id: str = "model-1") -> None:
    with factory.begin() as s:
        s.add(SessionRecord(id="session-1", tags=["a"], user_metadata={"k": "v"}, sdk_version="0.5.0"))
        s.flush()
        s.add(ModelRecord(id=model_id, session_id="session-1", base_model="tiny-qwen3", lora_rank=8,
                          lora_config={"rank": 8, "seed": 1, "train_attn": True, "train_mlp": True,
                                       "train_unembed": False, "alpha": 16}))


def future(model_id: str | None, seq_id: int | None, fid: str, **kwargs: object) -> FutureRecord:
    request = {"model_id": model_id, "seq_id": seq_id, "data": [1, 2, 3]}
    return FutureRecord(id=fid, session_id="session-1", model_id=model_id, request_type="forward_backward",
                        seq_id=seq_id, request=request, request_hash=request_hash(request), **kwargs)


def test_insert_and_query_every_record_type(db: sessionmaker[Session]) -> None:
    add_session_and_model(db)
    expires = datetime(2030, 1, 2, 3, 4, 5, 678901, tzinfo=timezone(timedelta(hours=2)))
    with db.begin() as s:
        s.add(future("model-1", 0, "future-1"))
        s.add(CheckpointRecord(model_id="model-1", kind="sampler_weights", name="step-1",
                               tinker_path="tinker://model-1/sampler_weights/step-1",
                               storage_uri="file:///ckpt/model-1/sampler_weights/step-1",
                               size_bytes=5 * 2**32, expires_at=expires))
        s.add(SamplingSessionRecord(id="sampling-1", session_id="session-1", base_model="tiny-qwen3",
                                    model_path="tinker://model-1/sampler_weights/step-1", model_id="model-1",
                                    snapshot_id="model-1@step-1"))
    with db() as s:
        session = s.get(SessionRecord, "session-1")
        assert session is not None
        assert (session.tags, session.user_metadata, session.sdk_version) == (["a"], {"k": "v"}, "0.5.0")
        assert session.status == SessionStatus.ACTIVE
        assert session.created_at.tzinfo == timezone.utc and session.last_heartbeat_at.tzinfo == timezone.utc
        assert abs(datetime.now(timezone.utc) - session.created_at) < timedelta(minutes=5)

        model = s.get(ModelRecord, "model-1")
        assert model is not None and model.status == ModelStatus.PENDING and model.lora_rank == 8
        assert model.lora_config["alpha"] == 16 and model.user_metadata == {} and model.last_request_at is None

        fut = s.get(FutureRecord, "future-1")
        assert fut is not None
        assert (fut.status, fut.attempts, fut.result, fut.error) == (FutureStatus.PENDING, 0, None, None)
        assert fut.request == {"model_id": "model-1", "seq_id": 0, "data": [1, 2, 3]}
        assert fut.request_hash == request_hash(fut.request) and len(fut.request_hash) == 64

        ckpt = s.scalars(sa.select(CheckpointRecord)).one()
        assert isinstance(ckpt.id, int) and ckpt.status == CheckpointStatus.WRITING
        assert ckpt.size_bytes == 5 * 2**32  # beyond 32 bits
        assert ckpt.expires_at == expires and ckpt.expires_at.tzinfo == timezone.utc

        sampling = s.get(SamplingSessionRecord, "sampling-1")
        assert sampling is not None and sampling.snapshot_id == "model-1@step-1"


def test_future_lifecycle_update_and_claim_order(db: sessionmaker[Session]) -> None:
    add_session_and_model(db)
    base = datetime(2026, 1, 1, tzinfo=timezone.utc)
    with db.begin() as s:
        for i in range(3):
            s.add(future("model-1", i, f"f{i}", created_at=base + timedelta(seconds=10 - i)))
    with db.begin() as s:
        # A conditional UPDATE is the atomic claim on every backend.
        claimed = s.execute(sa.update(FutureRecord)
                            .where(FutureRecord.id == "f1", FutureRecord.status == FutureStatus.PENDING)
                            .values(status=FutureStatus.RUNNING, started_at=base, attempts=FutureRecord.attempts + 1))
        assert claimed.rowcount == 1
    with db.begin() as s:
        fut = s.get(FutureRecord, "f1")
        assert fut is not None
        fut.status, fut.completed_at = FutureStatus.FAILED, base + timedelta(seconds=1)
        fut.error = {"category": "user", "message": "bad input", "code": "invalid_argument"}
    with db() as s:
        pending = s.scalars(sa.select(FutureRecord.id).where(FutureRecord.status == FutureStatus.PENDING)
                            .order_by(FutureRecord.created_at)).all()
        assert pending == ["f2", "f0"]  # oldest first
        fut = s.get(FutureRecord, "f1")
        assert fut is not None and fut.attempts == 1 and fut.started_at == base
        assert fut.error == {"category": "user", "message": "bad input", "code": "invalid_argument"}
        assert s.scalars(sa.select(FutureRecord.id).where(FutureRecord.created_at < base + timedelta(seconds=9))
                         ).all() == ["f2"]


def test_duplicate_model_seq_id_is_rejected(db: sessionmaker[Session]) -> None:
    add_session_and_model(db)
    with db.begin() as s:
        s.add(future("model-1", 7, "first"))
    with pytest.raises(IntegrityError, match="(?i)unique|uq_futures_model_seq"):
        with db.begin() as s:
            s.add(future("model-1", 7, "retry"))


def test_null_seq_ids_and_other_models_do_not_collide(db: sessionmaker[Session]) -> None:
    add_session_and_model(db)
    with db.begin() as s:
        s.add(ModelRecord(id="model-2", session_id="session-1", base_model="tiny-qwen3", lora_rank=0))
    with db.begin() as s:
        s.add_all([future("model-1", None, "a"), future("model-1", None, "b"), future(None, None, "c"),
                   future(None, None, "d"), future("model-1", 3, "e"), future("model-2", 3, "f")])
    with db() as s:
        assert s.scalar(sa.select(sa.func.count()).select_from(FutureRecord)) == 6


def test_json_round_trip(db: sessionmaker[Session]) -> None:
    add_session_and_model(db)
    payload = {"unicode": "héllo ✓ 你好", "float": 0.1, "neg": -1.5e-7, "big": 2**53, "bool": [True, False],
               "none": None, "nested": {"list": [[1, 2], [], [{"a": None}]], "empty": {}}}
    with db.begin() as s:
        s.add(future("model-1", 1, "json", result=payload))
        s.add(future("model-1", 2, "no-result"))
        s.add(future("model-1", 3, "list-result", result=[1, "two", None]))
    with db() as s:
        assert s.get(FutureRecord, "json").result == payload  # type: ignore[union-attr]
        assert s.get(FutureRecord, "list-result").result == [1, "two", None]  # type: ignore[union-attr]
        # Python None in a nullable JSON column is SQL NULL, found by IS NULL.
        no_result = s.scalars(sa.select(FutureRecord.id).where(FutureRecord.result.is_(None))
                              .order_by(FutureRecord.id)).all()
        assert no_result == ["no-result"]


def test_foreign_keys_are_enforced(db: sessionmaker[Session]) -> None:
    with pytest.raises(IntegrityError, match="(?i)foreign key"):
        with db.begin() as s:
            s.add(ModelRecord(id="orphan", session_id="no-such-session", base_model="tiny-qwen3", lora_rank=8))
    with pytest.raises(IntegrityError, match="(?i)foreign key"):
        with db.begin() as s:
            s.add(future("no-such-model", 0, "orphan-future"))


def test_checkpoint_uniqueness(db: sessionmaker[Session]) -> None:
    add_session_and_model(db)

    def ckpt(name: str, path: str, kind: str = "weights") -> CheckpointRecord:
        return CheckpointRecord(model_id="model-1", kind=kind, name=name, tinker_path=path, storage_uri="file:///x")

    with db.begin() as s:
        s.add_all([ckpt("a", "tinker://model-1/weights/a"), ckpt("a", "tinker://model-1/sampler_weights/a",
                                                                  kind="sampler_weights")])
    with pytest.raises(IntegrityError):
        with db.begin() as s:
            s.add(ckpt("a", "tinker://model-1/weights/a-again"))  # same (model, kind, name)
    with pytest.raises(IntegrityError):
        with db.begin() as s:
            s.add(ckpt("b", "tinker://model-1/weights/a"))  # same tinker_path


def test_naive_datetimes_are_rejected(db: sessionmaker[Session]) -> None:
    with pytest.raises(StatementError, match="naive datetime"):
        with db.begin() as s:
            s.add(SessionRecord(id="s", created_at=datetime(2026, 1, 1)))


def test_request_hash_is_canonical() -> None:
    assert request_hash({"a": 1, "b": [1, 2]}) == request_hash({"b": [1, 2], "a": 1})
    assert request_hash({"a": 1}) != request_hash({"a": 2})
    with pytest.raises(ValueError):
        request_hash({"x": float("nan")})


def test_sqlite_engine_pragmas(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'new' / 'dir' / 'p.db'}")  # parent directories are created
    try:
        with engine.connect() as connection:
            assert connection.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert connection.exec_driver_sql("PRAGMA busy_timeout").scalar() == 5000
            assert connection.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
    finally:
        engine.dispose()


def test_default_database_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert default_database_url(tmp_path / "a") == f"sqlite:///{(tmp_path / 'a' / 'skyrl_tx.db').resolve()}"
    assert (tmp_path / "a").is_dir()
    monkeypatch.setenv("SKYRL_TX_DATA_DIR", str(tmp_path / "env"))
    assert default_database_url() == f"sqlite:///{(tmp_path / 'env' / 'skyrl_tx.db').resolve()}"
    assert (tmp_path / "env").is_dir()
    monkeypatch.delenv("SKYRL_TX_DATA_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    assert default_database_url().endswith("/home/.local/share/skyrl_tx/skyrl_tx.db")


def test_postgresql_urls_get_the_psycopg_driver() -> None:
    assert normalize_url("postgresql://u:p@h:5432/db").drivername == "postgresql+psycopg"
    assert normalize_url("postgres://u@h/db").drivername == "postgresql+psycopg"
    assert normalize_url("postgresql+psycopg://u@h/db").drivername == "postgresql+psycopg"
    assert normalize_url("sqlite:///x.db").drivername == "sqlite"
    assert normalize_url("postgresql://u:p%40ss@h/db").password == "p@ss"


def test_a_non_finite_result_is_stored_as_strings_not_refused(db: sessionmaker[Session]) -> None:
    """A diverged model's NaN grad_norm must not fail the engine's FINISH: PostgreSQL's JSON type refuses bare NaN."""
    add_session_and_model(db)
    with db.begin() as s:
        s.add(future("model-1", 1, "f", result={"metrics": {"grad_norm": float("nan"), "x": float("-inf")}}))
    with db() as s:
        assert s.get(FutureRecord, "f").result == {"metrics": {"grad_norm": "NaN", "x": "-Infinity"}}
