"""study_bests: the fastest completed trial per study and device count

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30 13:15:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from tuner.outcome import TrialState

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
    # The rebuild as it was at this revision (tuner/store/results.py's REBUILD_BESTS_SQL then):
    # the live one names later columns (tp_col, 0007) that do not exist yet here.
    op.execute(
        sa.text("""
INSERT INTO study_bests (study_id, world_size, trial_id, tokens_per_s)
SELECT study_id, world, id, tokens_per_s FROM (
    SELECT id, study_id, tp * pp * dp AS world, tokens_per_s,
           ROW_NUMBER() OVER (PARTITION BY study_id, tp * pp * dp ORDER BY tokens_per_s DESC, id) AS r
    FROM trials WHERE state = :complete AND tokens_per_s IS NOT NULL
) ranked WHERE r = 1
""").bindparams(complete=TrialState.COMPLETE.value)  # the stored value, the same since revision 0001
    )


def downgrade() -> None:
    op.drop_table("study_bests")
