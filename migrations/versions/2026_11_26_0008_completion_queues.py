"""completion_queues: a sample's sampling-session completion queue and its place in it, for retrieve_futures

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-26 09:00:00

"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | Sequence[str] | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("futures") as batch:
        batch.add_column(sa.Column("completion_queue", sa.String(), nullable=True))
        batch.add_column(sa.Column("completion_cursor", sa.BigInteger(), nullable=True))
    # retrieve_futures reads a queue by cursor; a cursor is handed out once per queue.
    op.create_index("ix_futures_completion_queue_cursor", "futures", ["completion_queue", "completion_cursor"],
                    unique=True)


def downgrade() -> None:
    op.drop_index("ix_futures_completion_queue_cursor", table_name="futures")
    with op.batch_alter_table("futures") as batch:
        batch.drop_column("completion_cursor")
        batch.drop_column("completion_queue")
