"""Every parallel axis a trial column (dp_replicate, dp_shard, ep, cp join the others) and the
trial's device count stored (world_size), read from each trial's layout. Until now the store
computed the device count in SQL as tp x tp_col x pp x dp and left cp out, so a context-parallel
trial's devices were undercounted by cp (budgets, bests per device count); study_bests is rebuilt
from the stored counts. activation_checkpoint widens to the 32 characters every string axis has.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-05 12:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from tuner.outcome import TrialState

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

NEW_AXES = ("dp_replicate", "dp_shard", "ep", "cp")
# The layout axes that multiply the world at this revision (trainer/contract/axes.py then).
WORLD = ("tp", "tp_col", "pp", "dp_replicate", "dp_shard", "cp")
COMPLETE = TrialState.COMPLETE.value  # the stored value, the same since revision 0001


def _rebuild_bests(world: str) -> None:
    op.execute("DELETE FROM study_bests")
    op.execute(
        sa.text(f"""
INSERT INTO study_bests (study_id, world_size, trial_id, tokens_per_s)
SELECT study_id, world, id, tokens_per_s FROM (
    SELECT id, study_id, {world} AS world, tokens_per_s,
           ROW_NUMBER() OVER (PARTITION BY study_id, {world} ORDER BY tokens_per_s DESC, id) AS r
    FROM trials WHERE state = :complete AND tokens_per_s IS NOT NULL
) ranked WHERE r = 1
""").bindparams(complete=COMPLETE)
    )


def upgrade() -> None:
    with op.batch_alter_table("trials") as batch:
        for name in NEW_AXES:
            batch.add_column(sa.Column(name, sa.Integer(), nullable=False, server_default="1"))
        batch.add_column(sa.Column("world_size", sa.Integer(), nullable=True))
        batch.alter_column("activation_checkpoint", existing_type=sa.String(16), type_=sa.String(32))
    trials = sa.table("trials", sa.column("id", sa.Integer), sa.column("config", sa.JSON),
                      *(sa.column(name, sa.Integer) for name in (*NEW_AXES, "world_size")))  # fmt: skip
    conn = op.get_bind()
    for trial_id, config in conn.execute(sa.select(trials.c.id, trials.c.config)).all():
        axes = {name: int(config.get(name, 1)) for name in (*WORLD, "ep")}
        world = 1
        for name in WORLD:
            world *= axes[name]
        values = {name: axes[name] for name in NEW_AXES}
        conn.execute(trials.update().where(trials.c.id == trial_id).values(world_size=world, **values))
    with op.batch_alter_table("trials") as batch:
        batch.alter_column("world_size", existing_type=sa.Integer(), nullable=False)
        batch.drop_index("ix_trials_study_state_world_tps")
        batch.create_index(
            "ix_trials_study_state_world_tps", ["study_id", "state", "world_size", "tokens_per_s"]
        )
    _rebuild_bests("world_size")


def downgrade() -> None:
    with op.batch_alter_table("trials") as batch:
        batch.drop_index("ix_trials_study_state_world_tps")
        batch.create_index(
            "ix_trials_study_state_world_tps", ["study_id", "state", "tp", "pp", "dp", "tokens_per_s"]
        )
    with op.batch_alter_table("trials") as batch:
        batch.alter_column("activation_checkpoint", existing_type=sa.String(32), type_=sa.String(16))
        for name in ("world_size", *NEW_AXES):
            batch.drop_column(name)
    _rebuild_bests("tp * tp_col * pp * dp")
