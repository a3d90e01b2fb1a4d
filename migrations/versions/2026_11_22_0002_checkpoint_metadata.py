"""checkpoints: user_metadata and model_meta (what loading a checkpoint needs)

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22 10:00:00

"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("checkpoints") as batch:  # batch mode: SQLite cannot drop columns in place
        batch.add_column(sa.Column("user_metadata", sa.JSON(none_as_null=True), nullable=True))
        batch.add_column(sa.Column("model_meta", sa.JSON(none_as_null=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("checkpoints") as batch:
        batch.drop_column("model_meta")
        batch.drop_column("user_metadata")
