"""initial schema: sessions, models, futures, checkpoints, sampling_sessions

Revision ID: 0001
Revises:
Create Date: 2026-11-22 02:59:14.615962

"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "sessions",
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("tags", sa.JSON(), nullable=False),
        sa.Column("user_metadata", sa.JSON(), nullable=False),
        sa.Column("sdk_version", sa.String(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_heartbeat_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("status", sa.String(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sessions")),
    )
    op.create_table(
        "models",
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("session_id", sa.String(), nullable=False),
        sa.Column("base_model", sa.String(), nullable=False),
        sa.Column("lora_rank", sa.Integer(), nullable=False),
        sa.Column("lora_config", sa.JSON(), nullable=False),
        sa.Column("user_metadata", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_request_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["session_id"], ["sessions.id"], name=op.f("fk_models_session_id_sessions")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_models")),
    )
    op.create_index(op.f("ix_models_session_id"), "models", ["session_id"], unique=False)

    op.create_table(
        "futures",
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("session_id", sa.String(), nullable=True),
        sa.Column("model_id", sa.String(), nullable=True),
        sa.Column("request_type", sa.String(), nullable=False),
        sa.Column("seq_id", sa.Integer(), nullable=True),
        sa.Column("request", sa.JSON(), nullable=False),
        sa.Column("request_hash", sa.String(length=64), nullable=False),
        sa.Column("status", sa.String(), nullable=False),
        sa.Column("result", sa.JSON(), nullable=True),
        sa.Column("error", sa.JSON(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("completed_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["model_id"], ["models.id"], name=op.f("fk_futures_model_id_models")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_futures")),
        sa.UniqueConstraint("model_id", "seq_id", name="uq_futures_model_seq"),
    )
    op.create_index("ix_futures_status_created_at", "futures", ["status", "created_at"], unique=False)

    op.create_table(
        "checkpoints",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("model_id", sa.String(), nullable=False),
        sa.Column("kind", sa.String(), nullable=False),
        sa.Column("name", sa.String(), nullable=False),
        sa.Column("tinker_path", sa.String(), nullable=False),
        sa.Column("storage_uri", sa.String(), nullable=False),
        sa.Column("status", sa.String(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["model_id"], ["models.id"], name=op.f("fk_checkpoints_model_id_models")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_checkpoints")),
        sa.UniqueConstraint("model_id", "kind", "name", name=op.f("uq_checkpoints_model_id_kind_name")),
        sa.UniqueConstraint("tinker_path", name=op.f("uq_checkpoints_tinker_path")),
    )

    op.create_table(
        "sampling_sessions",
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("session_id", sa.String(), nullable=False),
        sa.Column("base_model", sa.String(), nullable=False),
        sa.Column("model_path", sa.String(), nullable=True),
        sa.Column("model_id", sa.String(), nullable=True),
        sa.Column("snapshot_id", sa.String(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["session_id"], ["sessions.id"],
                                name=op.f("fk_sampling_sessions_session_id_sessions")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sampling_sessions")),
    )
    op.create_index(op.f("ix_sampling_sessions_session_id"), "sampling_sessions", ["session_id"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_sampling_sessions_session_id"), table_name="sampling_sessions")
    op.drop_table("sampling_sessions")
    op.drop_table("checkpoints")
    op.drop_index("ix_futures_status_created_at", table_name="futures")
    op.drop_table("futures")
    op.drop_index(op.f("ix_models_session_id"), table_name="models")
    op.drop_table("models")
    op.drop_table("sessions")
