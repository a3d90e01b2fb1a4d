"""sampling_session_clients: how many further clients joined each sampling session (join_sampling_session), so the
numbers handed out stay unique across restarts

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-26 12:00:00

"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | Sequence[str] | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("sampling_sessions") as batch:
        batch.add_column(sa.Column("clients_joined", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("sampling_sessions") as batch:
        batch.drop_column("clients_joined")
