"""request_timings: the engine's per-request phase times on each future (seq-order wait ended, compute done)

Stamped in the UPDATE that stores the result (no extra write per request); with created_at (stored), started_at
(claimed) and completed_at (result stored) they are the phases the session trace export and `bench latency` show.

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-29 04:40:00

"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | Sequence[str] | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("futures") as batch:
        batch.add_column(sa.Column("ordered_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("computed_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("futures") as batch:
        batch.drop_column("computed_at")
        batch.drop_column("ordered_at")
