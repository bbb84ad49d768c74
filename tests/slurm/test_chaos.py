"""The short chaos run (bench/chaos.py): 8 real trials on a real Slurm cluster and PostgreSQL with
two workers, while the driver injects faults of every kind it knows; nothing lost, nothing run
twice, no job the database does not know. No calm run first (`--no-calm`): which layout won is
not asserted here. The full run (24 trials, calm run included) is in docs/benchmarks.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slurm, pytest.mark.distributed]

ROOT = Path(__file__).resolve().parents[2]


def _workers_of(tmp_path: Path) -> list[int]:
    """PIDs of `tuner worker`s whose work dir is under tmp_path (the run's, by their environment)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if (
                b"worker" in (proc / "cmdline").read_bytes()
                and str(tmp_path).encode() in (proc / "environ").read_bytes()
            ):
                pids.append(int(proc.name))
        except (OSError, ValueError):
            continue
    return pids


@pytest.mark.timeout(1600)  # the run's own limit below, with room: pytest's would kill it mid-cleanup
def test_a_short_chaos_run_loses_nothing_and_runs_nothing_twice(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "bench.chaos", "--trials", "8", "--seed", "1", "--no-calm", "--json", "--keep",
                             str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=1500)
    finally:
        if proc.poll() is None:  # timed out or interrupted: SIGTERM lets it stop its workers and clusters
            proc.terminate()
            try:
                proc.communicate(timeout=180)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
        assert not _workers_of(tmp_path), "the chaos run left workers behind"
    done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
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
