"""A trial pruned while running is a measurement, not a failure: why it stopped goes to its own
column, `stop_reason`, and its failure kind ('pruned_running' until now) and failure message are
cleared. Its state stays PRUNED and its partial measurement stays in the metric columns. The
downgrade puts them back as they were.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03 09:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

# The failure kind such trials were stored with before this revision (tuner/outcome.py: the
# attempt-log kind PRUNED_RUNNING, which keeps this value).
OLD_KIND = "pruned_running"


def upgrade() -> None:
    with op.batch_alter_table("trials") as batch:
        batch.add_column(sa.Column("stop_reason", sa.Text(), nullable=True))
    op.execute(
        sa.text(
            "UPDATE trials SET stop_reason = COALESCE(failure_message, ''), failure_kind = NULL, "
            "failure_message = NULL WHERE failure_kind = :kind"
        ).bindparams(kind=OLD_KIND)
    )


def downgrade() -> None:
    op.execute(
        sa.text(
            "UPDATE trials SET failure_kind = :kind, failure_message = stop_reason WHERE stop_reason IS NOT NULL"
        ).bindparams(kind=OLD_KIND)
    )
    with op.batch_alter_table("trials") as batch:
        batch.drop_column("stop_reason")
