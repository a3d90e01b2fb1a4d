"""audit_events: the append-only audit log of actions on a key's objects (models, checkpoints, sessions, keys)

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-29 01:45:00

"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | Sequence[str] | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

INDEXED = ("created_at", "actor_key_id", "owner_key_id")


def upgrade() -> None:
    op.create_table("audit_events",
                    sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
                    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
                    sa.Column("event", sa.String(), nullable=False),
                    sa.Column("actor_key_id", sa.String(), nullable=True),
                    sa.Column("owner_key_id", sa.String(), nullable=True),
                    sa.Column("resource", sa.String(), nullable=False),
                    sa.Column("details", sa.JSON(), nullable=False),
                    sa.Column("request_id", sa.String(length=128), nullable=True),
                    sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_events")))
    for column in INDEXED:
        op.create_index(f"ix_audit_events_{column}", "audit_events", [column])


def downgrade() -> None:
    for column in INDEXED:
        op.drop_index(f"ix_audit_events_{column}", table_name="audit_events")
    op.drop_table("audit_events")
