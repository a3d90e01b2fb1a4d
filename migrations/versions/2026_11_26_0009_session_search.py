"""session_search: what sessions/search filters on and reports: a session's display name, project and the finish
reason its client gave (ServiceClient.close)

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-26 09:00:00

"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | Sequence[str] | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("sessions") as batch:
        batch.add_column(sa.Column("display_name", sa.String(), nullable=True))
        batch.add_column(sa.Column("project_id", sa.String(), nullable=True))
        batch.add_column(sa.Column("finish_reason", sa.String(), nullable=True))
        batch.add_column(sa.Column("finish_detail", sa.Text(), nullable=True))
        batch.create_index("ix_sessions_created_at", ["created_at"])


def downgrade() -> None:
    with op.batch_alter_table("sessions") as batch:
        batch.drop_index("ix_sessions_created_at")
        batch.drop_column("finish_detail")
        batch.drop_column("finish_reason")
        batch.drop_column("project_id")
        batch.drop_column("display_name")
