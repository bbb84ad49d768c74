"""Study leases and pauses; per-attempt log, device-seconds and feedback of trials; typed job handles

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 09:00:00
"""

from __future__ import annotations

import socket

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("studies") as batch:
        batch.add_column(sa.Column("lease_owner", sa.String(length=200), nullable=True))
        batch.add_column(sa.Column("lease_host", sa.String(length=255), nullable=True))
        batch.add_column(sa.Column("lease_pid", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("lease_renewed_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("resume_after", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("dispatch_failures", sa.Integer(), nullable=False, server_default="0"))
        batch.drop_column("worker")
    with op.batch_alter_table("trials") as batch:
        batch.add_column(sa.Column("attempt_log", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("device_s", sa.Float(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("told", sa.String(length=16), nullable=True))
    _typed_job_handles()


def _typed_job_handles() -> None:
    """Job ids were '<slurm id>@<dir>', '<pid>@<dir>' (local) or 'step:<alloc>:<pid>@<dir>'; they
    become '<kind>:<id>@<dir>' (tuner/dispatch/base.py: JobHandle). Which kind a bare number is
    follows from the study's backend; a local pid was on this host (one machine per SQLite)."""
    conn = op.get_bind()
    rows = conn.execute(
        sa.text(
            "SELECT t.id, t.job_id, s.spec FROM trials t JOIN studies s ON s.id = t.study_id "
            "WHERE t.job_id IS NOT NULL"
        )
    ).all()
    host = socket.gethostname()
    for trial_id, job_id, spec in rows:
        spec = spec if isinstance(spec, dict) else __import__("json").loads(spec)
        head, _, work_dir = job_id.partition("@")
        if head.startswith("step:"):
            _, alloc, pid = head.split(":", 2)
            new = f"step:{alloc}/{host}/{pid}@{work_dir}"
        elif head.isdigit() and spec.get("backend") == "slurm":
            new = f"slurm:{head}@{work_dir}"
        elif head.isdigit():
            new = f"local:{host}/{head}@{work_dir}"
        else:
            continue
        conn.execute(sa.text("UPDATE trials SET job_id = :j WHERE id = :i"), {"j": new, "i": trial_id})


def downgrade() -> None:
    with op.batch_alter_table("trials") as batch:
        batch.drop_column("told")
        batch.drop_column("device_s")
        batch.drop_column("attempt_log")
    with op.batch_alter_table("studies") as batch:
        batch.add_column(sa.Column("worker", sa.String(length=200), nullable=True))
        for name in ("dispatch_failures", "resume_after", "lease_renewed_at", "lease_expires_at", "lease_pid",
                     "lease_host", "lease_owner"):  # fmt: skip
            batch.drop_column(name)
