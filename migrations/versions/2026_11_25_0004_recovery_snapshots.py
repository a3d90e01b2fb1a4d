"""recovery_snapshots: periodic internal snapshots that bound an engine restart's replay; futures by age

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-25 06:30:00

"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "recovery_snapshots",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("model_id", sa.String(), nullable=False),
        sa.Column("seq_id", sa.Integer(), nullable=False),
        sa.Column("optimizer_step", sa.Integer(), nullable=False),
        sa.Column("location", sa.String(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("taken_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["model_id"], ["models.id"], name=op.f("fk_recovery_snapshots_model_id_models")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_recovery_snapshots")),
    )
    op.create_index(op.f("ix_recovery_snapshots_model_id"), "recovery_snapshots", ["model_id"], unique=False)
    # The retention sweep looks for finished futures by age.
    op.create_index("ix_futures_status_completed_at", "futures", ["status", "completed_at"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_futures_status_completed_at", table_name="futures")
    op.drop_index(op.f("ix_recovery_snapshots_model_id"), table_name="recovery_snapshots")
    op.drop_table("recovery_snapshots")
