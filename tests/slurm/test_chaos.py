"""The short chaos run (bench/chaos.py): 8 real trials on a real Slurm cluster and PostgreSQL with
two workers, while the driver injects faults of every kind it knows; nothing lost, nothing run
twice, no job the database does not know. The full run (24 trials) is in docs/benchmarks.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slurm, pytest.mark.distributed]

ROOT = Path(__file__).resolve().parents[2]


def test_a_short_chaos_run_loses_nothing_and_runs_nothing_twice(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "bench.chaos", "--trials", "8", "--seed", "1", "--json", "--keep",
                           str(tmp_path)], capture_output=True, text=True, timeout=1500, cwd=ROOT)  # fmt: skip
    assert done.stdout.strip(), done.stderr[-3000:]
    figures = json.loads(done.stdout)
    summary = {
        k: figures[k] for k in ("study_status", "trials", "lost", "duplicated", "orphan_jobs", "told_wrongly")
    }
    assert summary == {"study_status": "COMPLETE", "trials": 8, "lost": 0, "duplicated": 0, "orphan_jobs": 0,
                       "told_wrongly": []}, figures  # fmt: skip
    assert figures["within_budget"] and done.returncode == 0, figures
    assert len(figures["faults_injected"]) >= 4, figures["events"]  # kinds
    # Every failed attempt was of a kind the faults cause, and re-run where the policy says so.
    assert set(figures["attempt_kinds"]) <= {"ok", "infra", "crash", "cancelled", "dispatch_error"}, figures
    assert figures["attempt_kinds"].get("infra", 0) == figures["infra_attempts_retried"], figures
