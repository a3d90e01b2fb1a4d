"""stability_uses: when each recorded sample (record_stability_info) was last named by a datum's provenance spans,
so its record expires a day after its last use

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-26 18:40:00

"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | Sequence[str] | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table("stability_uses",
                    sa.Column("request_id", sa.String(), primary_key=True),
                    sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=False))
    op.create_index("ix_stability_uses_last_used_at", "stability_uses", ["last_used_at"])


def downgrade() -> None:
    op.drop_index("ix_stability_uses_last_used_at", table_name="stability_uses")
    op.drop_table("stability_uses")
