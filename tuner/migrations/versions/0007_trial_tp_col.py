"""The column degree of 2D tensor parallelism (tp_col) as a trial column: world size = tp x tp_col
x pp x dp is computed in SQL (bests per world size, usage), so it cannot live in the config JSON
alone. Existing trials have no column axis: 1. The layout key (every knob as JSON) grows by
',"tp_col":N' and outgrows 200 characters with the longest knob values: 300.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01 10:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("trials") as batch:
        batch.add_column(sa.Column("tp_col", sa.Integer(), nullable=False, server_default="1"))
        batch.alter_column("layout_key", existing_type=sa.String(length=200), type_=sa.String(length=300))


def downgrade() -> None:
    with op.batch_alter_table("trials") as batch:
        batch.alter_column("layout_key", existing_type=sa.String(length=300), type_=sa.String(length=200))
        batch.drop_column("tp_col")
