"""calibrations: performance-model constants fitted per cluster

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 12:10:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "calibrations",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("cluster_key", sa.String(length=100), nullable=False),
        sa.Column("constants", sa.JSON(), nullable=False),
        sa.Column("num_points", sa.Integer(), nullable=False),
        sa.Column("rms_log_error", sa.Float(), nullable=False),
        sa.Column("study_id", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["study_id"], ["studies.id"], ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_calibrations_cluster_key", "calibrations", ["cluster_key"])


def downgrade() -> None:
    op.drop_index("ix_calibrations_cluster_key", table_name="calibrations")
    op.drop_table("calibrations")
