"""study_bests: the fastest completed trial per study and device count

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30 13:15:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "study_bests",
        sa.Column("study_id", sa.Integer(), nullable=False),
        sa.Column("world_size", sa.Integer(), nullable=False),
        sa.Column("trial_id", sa.Integer(), nullable=False),
        sa.Column("tokens_per_s", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["study_id"], ["studies.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["trial_id"], ["trials.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("study_id", "world_size"),
    )
    from tuner.store import REBUILD_BESTS_SQL

    for statement in REBUILD_BESTS_SQL.strip().split(";"):
        op.execute(statement)


def downgrade() -> None:
    op.drop_table("study_bests")
