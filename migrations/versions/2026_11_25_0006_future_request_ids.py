"""future_request_ids: the X-Request-Id of the request that created each future, for the engine's log lines

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-25 10:25:00

"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("futures") as batch:
        batch.add_column(sa.Column("request_id", sa.String(length=128), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("futures") as batch:
        batch.drop_column("request_id")
