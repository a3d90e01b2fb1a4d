"""inflight_sampler_weights: a training model's one mutable sampler target (SDK 0.38 kind="inflight")

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-26 15:00:00

"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("models") as batch:
        batch.add_column(sa.Column("inflight_snapshot_id", sa.String(), nullable=True))
    with op.batch_alter_table("sampling_sessions") as batch:
        batch.add_column(sa.Column("inflight", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("sampling_sessions") as batch:
        batch.drop_column("inflight")
    with op.batch_alter_table("models") as batch:
        batch.drop_column("inflight_snapshot_id")
