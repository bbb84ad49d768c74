"""trials.job_state (the scheduler's state of a trial's job); longer job ids

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30 12:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("trials") as batch:
        batch.add_column(sa.Column("job_state", sa.String(length=32), nullable=True))
        batch.alter_column("job_id", type_=sa.String(length=600), existing_type=sa.String(length=200))


def downgrade() -> None:
    with op.batch_alter_table("trials") as batch:
        batch.alter_column("job_id", type_=sa.String(length=200), existing_type=sa.String(length=600))
        batch.drop_column("job_state")
