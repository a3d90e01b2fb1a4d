"""The database schema: SQLAlchemy 2 declarative models, one class per table (`*Record`, tables plural).

The schema is created and changed only by the Alembic migrations in `migrations/` (`skyrl-tx db upgrade`,
`skyrl_tx.db.migrate.upgrade`); `metadata.create_all` is never called at runtime. After changing a model,
add a revision: `skyrl-tx db revision -m "..." --autogenerate`, then review it.

Conventions, the same on SQLite and PostgreSQL:
* Datetimes are timezone-aware UTC (`UTCDateTime`): naive values are rejected on write, and values read
  back always carry `tzinfo=UTC` (SQLite stores UTC text without an offset).
* Bulk tensors (a forward_backward's datums, its results) are never JSON: they are LargeBinary columns holding
  the SDK's protobuf (`FutureRecord.request_body` / `result_body`), deferred so that ORM reads skip them.
* JSON columns use `sqlalchemy.JSON`. Nullable JSON columns store Python `None` as SQL NULL. In-place
  mutation of a loaded dict/list is not tracked: assign a new value to persist a change.
* Status and kind columns are plain strings; the valid values are the `StrEnum`s below.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timedelta, timezone
from enum import StrEnum
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Dialect,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy import false
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

# Stable constraint and index names on every backend, so autogenerate and batch migrations can refer to them.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class UTCDateTime(TypeDecorator[datetime]):
    """`DateTime(timezone=True)` that only takes aware datetimes and always returns UTC-aware ones."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None or value.utcoffset() is None:
            raise ValueError(f"naive datetime {value.isoformat()}: pass a timezone-aware value, "
                             "e.g. datetime.now(timezone.utc)")
        value = value.astimezone(timezone.utc)
        # SQLite keeps no offset: store UTC wall-clock text so ordering and comparisons stay correct.
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=timezone.utc)
        return value.astimezone(timezone.utc)


# JSON that may be absent: Python None is SQL NULL (not the JSON literal `null`), so `IS NULL` finds it.
NullableJSON = JSON(none_as_null=True)


class SessionStatus(StrEnum):
    ACTIVE = "active"
    EXPIRED = "expired"


class ModelStatus(StrEnum):
    PENDING = "pending"
    READY = "ready"
    UNLOADED = "unloaded"
    FAILED = "failed"


class FutureStatus(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"


class CheckpointKind(StrEnum):
    WEIGHTS = "weights"
    SAMPLER_WEIGHTS = "sampler_weights"
    EXTERNAL_WEIGHTS = "external_weights"


class CheckpointStatus(StrEnum):
    WRITING = "writing"
    READY = "ready"
    FAILED = "failed"
    DELETED = "deleted"


# FutureRecord.request_type values (the Tinker operations a future can carry).
REQUEST_TYPES = frozenset({
    "create_model", "forward", "forward_backward", "optim_step", "save_weights", "save_weights_external",
    "save_weights_for_sampler", "load_weights", "sample", "unload_model", "create_custom_loss",
})


def request_hash(request: Any, body: bytes | None = None) -> str:
    """sha256 (hex) of a canonical JSON encoding of `request` (key order and whitespace do not change it), then of
    the binary body's bytes as they are (a retry of the SDK's protobuf is the same bytes). Hashing 2.1 MB of
    protobuf (a 131k-token forward_backward) takes ~1 ms; canonical JSON of the same datums took ~75 ms.

    Stored as FutureRecord.request_hash: a retried (model_id, seq_id) with the same hash is the same
    request; a different hash is a conflict (409).
    """
    canonical = json.dumps(request, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    digest = hashlib.sha256(canonical.encode("utf-8"))
    if body is not None:
        digest.update(b"\0")  # JSON text never holds a NUL byte: the two parts cannot run into each other
        digest.update(body)
    return digest.hexdigest()


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class ApiKeyRecord(Base):
    """An API key (`skyrl-tx keys create`): only the sha256 of the key is stored, never the key itself. Keys are
    revoked, never deleted, so the objects they own keep a valid owner id."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String, primary_key=True)  # the owner id of what the key creates
    name: Mapped[str] = mapped_column(String, unique=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex of the whole key
    key_prefix: Mapped[str] = mapped_column(String)  # its first characters, to recognise it in `keys list`
    admin: Mapped[bool] = mapped_column(Boolean, default=False)  # sees and acts on every key's objects
    max_live_models: Mapped[int | None] = mapped_column(Integer, nullable=True)  # None: no quota
    max_inflight_requests: Mapped[int | None] = mapped_column(Integer, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)


class SessionRecord(Base):
    """A client session (one `tinker.ServiceClient`); kept alive by heartbeats. Its owner owns everything made in
    it: models (and their futures and checkpoints) and sampling sessions (api/ownership.py)."""

    __tablename__ = "sessions"

    id: Mapped[str] = mapped_column(String, primary_key=True)
    # The API key that created it (api_keys.id); None: made with --auth none (the one implicit owner).
    owner_key_id: Mapped[str | None] = mapped_column(String, nullable=True, index=True)
    tags: Mapped[list[str]] = mapped_column(JSON, default=list)
    user_metadata: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    sdk_version: Mapped[str | None] = mapped_column(String, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, index=True)  # sessions/search's order
    last_heartbeat_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    status: Mapped[str] = mapped_column(String, default=SessionStatus.ACTIVE.value)
    display_name: Mapped[str | None] = mapped_column(String, nullable=True)
    project_id: Mapped[str | None] = mapped_column(String, nullable=True)  # None: the default project
    # What the client said when it closed the session (success | errored | interrupted), first close wins; None:
    # never closed by its client (still active, or ended by the session timeout).
    finish_reason: Mapped[str | None] = mapped_column(String, nullable=True)
    finish_detail: Mapped[str | None] = mapped_column(Text, nullable=True)


class ModelRecord(Base):
    """A training client's model: a LoRA adapter (lora_rank > 0) or a full fine-tuning copy (lora_rank 0)."""

    __tablename__ = "models"

    id: Mapped[str] = mapped_column(String, primary_key=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id"), index=True)
    # Its session's owner, copied so that the hot routes check ownership in the statement that reads the status.
    owner_key_id: Mapped[str | None] = mapped_column(String, nullable=True, index=True)
    base_model: Mapped[str] = mapped_column(String)
    lora_rank: Mapped[int] = mapped_column(Integer)
    # {"rank", "seed", "train_attn", "train_mlp", "train_unembed", "alpha"}
    lora_config: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    user_metadata: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    status: Mapped[str] = mapped_column(String, default=ModelStatus.PENDING.value)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    last_request_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    # The snapshot its inflight sampling clients sample (SDK kind="inflight"): the newest inflight save's.
    inflight_snapshot_id: Mapped[str | None] = mapped_column(String, nullable=True)


class FutureRecord(Base):
    """One accepted request: written by the API as pending, executed once by the engine, polled by the client."""

    __tablename__ = "futures"
    __table_args__ = (
        # A training client's seq_id is unique per model; NULL seq_ids never collide (SQL NULL semantics).
        UniqueConstraint("model_id", "seq_id", name="uq_futures_model_seq"),
        Index("ix_futures_status_created_at", "status", "created_at"),
    )

    id: Mapped[str] = mapped_column(String, primary_key=True)
    session_id: Mapped[str | None] = mapped_column(String, nullable=True)
    model_id: Mapped[str | None] = mapped_column(ForeignKey("models.id"), nullable=True)
    request_type: Mapped[str] = mapped_column(String)  # one of REQUEST_TYPES
    seq_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    request: Mapped[dict[str, Any]] = mapped_column(JSON)  # the parsed request (metadata only where there is a body)
    # forward / forward_backward: the SDK's ForwardBackwardRequest protobuf, uncompressed (engine/executor.py reads
    # it). Rows stored before migration 0003 have None here and their datums in `request["data"]`.
    request_body: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True, deferred=True)
    request_hash: Mapped[str] = mapped_column(String(64))  # request_hash(request, request_body)
    status: Mapped[str] = mapped_column(String, default=FutureStatus.PENDING.value)
    result: Mapped[Any | None] = mapped_column(NullableJSON, nullable=True)
    # forward / forward_backward: the ForwardBackwardOutput protobuf retrieve_future sends as is (`result` is None).
    result_body: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True, deferred=True)
    # {"category": "user" | "server", "message": str, "code": str}
    error: Mapped[dict[str, Any] | None] = mapped_column(NullableJSON, nullable=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    # X-Request-Id of the HTTP request that created it (api/request_ids.py): the engine's lines about it name it too.
    request_id: Mapped[str | None] = mapped_column(String(128), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)  # claimed by the engine
    completed_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)  # result stored
    # Phase times the engine stamps in the same UPDATE as completed_at (migration 0013; db/request_timings.py reads
    # them): when a request held back behind a missing seq_id became runnable (None: never held), and when its
    # compute returned (None: no separate compute step, e.g. a save, or an engine without the counting backend).
    ordered_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    computed_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    # A sample's completion queue (its sampling session and cloned sampler: db/completion_queues.py), and its place
    # in that queue, handed out by retrieve_futures once it has finished (None: not finished or not yet polled).
    completion_queue: Mapped[str | None] = mapped_column(String, nullable=True)
    completion_cursor: Mapped[int | None] = mapped_column(BigInteger, nullable=True)


class CheckpointRecord(Base):
    """Saved weights of a model; listed to clients only once status is "ready" (completely written)."""

    __tablename__ = "checkpoints"
    __table_args__ = (UniqueConstraint("model_id", "kind", "name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    model_id: Mapped[str] = mapped_column(ForeignKey("models.id"))
    kind: Mapped[str] = mapped_column(String)  # CheckpointKind
    name: Mapped[str] = mapped_column(String)
    tinker_path: Mapped[str] = mapped_column(String, unique=True)  # tinker://<model_id>/<kind path>/<name>
    storage_uri: Mapped[str] = mapped_column(String)  # where the files are (file:// or s3://)
    status: Mapped[str] = mapped_column(String, default=CheckpointStatus.WRITING.value)
    size_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    user_metadata: Mapped[dict[str, Any] | None] = mapped_column(NullableJSON, nullable=True)
    # skyrl_tx.checkpoints.formats.ModelMeta as JSON: what loading it needs, without reading the store
    model_meta: Mapped[dict[str, Any] | None] = mapped_column(NullableJSON, nullable=True)
    # Published: every key may read it (load, sample, download); only its model's owner may change it.
    public: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())


class SamplingSessionRecord(Base):
    """A sampling client, bound for its whole life to one set of weights (base, checkpoint or snapshot), or, inflight,
    to the newest inflight snapshot of its training model."""

    __tablename__ = "sampling_sessions"

    id: Mapped[str] = mapped_column(String, primary_key=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id"), index=True)
    base_model: Mapped[str] = mapped_column(String)
    model_path: Mapped[str | None] = mapped_column(String, nullable=True)  # tinker:// path it samples from
    model_id: Mapped[str | None] = mapped_column(String, nullable=True)
    snapshot_id: Mapped[str | None] = mapped_column(String, nullable=True)  # backend snapshot it is bound to
    # An inflight client follows its model's inflight_snapshot_id (never older than its own snapshot_id).
    inflight: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    # Further clients (unpickled copies, sampler handles) numbered by join_sampling_session so far.
    clients_joined: Mapped[int] = mapped_column(Integer, default=0, server_default="0")


class AuditRecord(Base):
    """One audit-log entry (GET /api/v1/audit): an action on a key's objects, written by the API in the transaction
    that accepts it (db/audit.py). Append-only: rows are never changed or deleted by the server."""

    __tablename__ = "audit_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)  # append order: the page cursor
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, index=True)
    event: Mapped[str] = mapped_column(String)  # <resource>_<action>, e.g. checkpoint_delete (db/audit.py EVENTS)
    # Who acted (api_keys.id; None: --auth none, or the `skyrl-tx keys` command line) and whose object it is.
    actor_key_id: Mapped[str | None] = mapped_column(String, nullable=True, index=True)
    owner_key_id: Mapped[str | None] = mapped_column(String, nullable=True, index=True)
    resource: Mapped[str] = mapped_column(String)  # what it is about: a model id, a tinker:// path, a key id
    details: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    request_id: Mapped[str | None] = mapped_column(String(128), nullable=True)  # X-Request-Id of the HTTP request


STABILITY_RECORD_TTL = timedelta(days=1)  # a stability record's life after its last use (StabilityUseRecord)


class StabilityUseRecord(Base):
    """When a recorded sample (asample with record_stability_info) was last named by a datum's provenance spans. The
    record itself is the sample's future (its prompt and sampled tokens); it expires a day after its last use, or
    after its completion if never used (api/provenance.py, engine/retention.py)."""

    __tablename__ = "stability_uses"

    request_id: Mapped[str] = mapped_column(String, primary_key=True)  # the sample future's id
    last_used_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, index=True)


class RecoverySnapshotRecord(Base):
    """A complete internal snapshot of a model's trainable state and AdamW state, taken right after the optim_step
    with seq_id `seq_id` (no gradients pending). A restart loads the newest usable one and replays only the
    completed requests after it (engine/recovery_state.py). Rows are written only once the files are durable."""

    __tablename__ = "recovery_snapshots"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    model_id: Mapped[str] = mapped_column(ForeignKey("models.id"), index=True)
    seq_id: Mapped[int] = mapped_column(Integer)  # the optim_step it follows
    optimizer_step: Mapped[int] = mapped_column(Integer)
    location: Mapped[str] = mapped_column(String)  # directory in the checkpoint store
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    # When the state was copied (engine clock): sampler snapshots created before it predate it.
    taken_at: Mapped[datetime] = mapped_column(UTCDateTime)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


# retrieve_futures reads a completion queue by cursor; a cursor is handed out once per queue (migration 0008).
Index("ix_futures_completion_queue_cursor", FutureRecord.__table__.c.completion_queue,
      FutureRecord.__table__.c.completion_cursor, unique=True)
# The retention sweep (engine/retention.py) looks for finished futures by age.
Index("ix_futures_status_completed_at", FutureRecord.__table__.c.status, FutureRecord.__table__.c.completed_at)
