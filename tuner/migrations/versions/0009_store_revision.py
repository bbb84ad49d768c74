"""store_revision: one row, a number every committed write bumps and the database's epoch, so that
readers (the API) can cache what they read and know when it is stale (tuner/db.py, tuner/cache.py).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03 12:00:00
"""

from __future__ import annotations

import uuid

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    table = op.create_table(
        "store_revision",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("epoch", sa.String(length=32), nullable=False),
        sa.Column("n", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.bulk_insert(table, [{"id": 1, "epoch": uuid.uuid4().hex, "n": 0}])


def downgrade() -> None:
    op.drop_table("store_revision")
