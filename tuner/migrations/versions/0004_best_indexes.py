"""indexes for "best layout" queries over many trials

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30 13:10:00
"""

from __future__ import annotations

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # a study's best trial: ORDER BY tokens_per_s within (study, COMPLETE)
    op.create_index("ix_trials_study_state_tps", "trials", ["study_id", "state", "tokens_per_s"])
    # best per (model, cluster, devices): MAX(tokens_per_s) GROUP BY study, tp*pp*dp, from the index alone
    op.create_index(
        "ix_trials_study_state_world_tps", "trials", ["study_id", "state", "tp", "pp", "dp", "tokens_per_s"]
    )


def downgrade() -> None:
    op.drop_index("ix_trials_study_state_world_tps", table_name="trials")
    op.drop_index("ix_trials_study_state_tps", table_name="trials")
