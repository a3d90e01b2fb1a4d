"""futures: binary request and result bodies (the SDK's protobuf), so tensors no longer go through JSON

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-25 06:00:00

"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Nullable, no default: rows stored before keep their datums in the JSON `request` (engine/executor.py reads
    # both forms). LargeBinary is BLOB on SQLite and BYTEA on PostgreSQL.
    with op.batch_alter_table("futures") as batch:  # batch mode: SQLite cannot drop columns in place
        batch.add_column(sa.Column("request_body", sa.LargeBinary(), nullable=True))
        batch.add_column(sa.Column("result_body", sa.LargeBinary(), nullable=True))


def downgrade() -> None:
    # Drops the bodies with their columns: run it on a drained server (older code cannot run rows stored since).
    with op.batch_alter_table("futures") as batch:
        batch.drop_column("result_body")
        batch.drop_column("request_body")
