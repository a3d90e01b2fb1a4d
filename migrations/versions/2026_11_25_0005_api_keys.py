"""api_keys: hashed API keys with quotas; sessions and models record the key that owns them; checkpoints can be published

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-25 09:10:00

"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("name", sa.String(), nullable=False),
        sa.Column("key_hash", sa.String(length=64), nullable=False),
        sa.Column("key_prefix", sa.String(), nullable=False),
        sa.Column("admin", sa.Boolean(), nullable=False),
        sa.Column("max_live_models", sa.Integer(), nullable=True),
        sa.Column("max_inflight_requests", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sa.UniqueConstraint("key_hash", name=op.f("uq_api_keys_key_hash")),
        sa.UniqueConstraint("name", name=op.f("uq_api_keys_name")),
    )
    # Nullable, no foreign key: rows made before keys (or with --auth none) have no owner, and keys are revoked,
    # never deleted. Plain ADD COLUMN on both backends (batch mode recreates a SQLite table only when it must).
    for table in ("sessions", "models"):
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column("owner_key_id", sa.String(), nullable=True))
            batch.create_index(op.f(f"ix_{table}_owner_key_id"), ["owner_key_id"], unique=False)
    with op.batch_alter_table("checkpoints") as batch:
        batch.add_column(sa.Column("public", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("checkpoints") as batch:
        batch.drop_column("public")
    for table in ("models", "sessions"):
        with op.batch_alter_table(table) as batch:
            batch.drop_index(op.f(f"ix_{table}_owner_key_id"))
            batch.drop_column("owner_key_id")
    op.drop_table("api_keys")
