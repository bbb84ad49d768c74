"""The local Slurm cluster of scripts/slurm-local.sh: jobs run, and sacct tells how they ended."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.slurm_cluster import SlurmCluster

pytestmark = pytest.mark.slurm


def sbatch(cluster: SlurmCluster, out: Path, *args: str) -> str:
    return cluster.run("sbatch", "--parsable", f"--output={out}", *args).strip()


def test_node_advertises_eight_cpus(slurm_cluster: SlurmCluster) -> None:
    out = slurm_cluster.run("sinfo", "--noheader", "--Node", "--format=%N %T %c %P")
    assert out.split() == [slurm_cluster.node, "idle", "8", "debug*"]


def test_two_task_batch_job_completes(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    out = tmp_path / "job.out"
    job_id = sbatch(slurm_cluster, out, "--ntasks=2", "--wrap", "srun hostname")
    assert slurm_cluster.wait_final_state(job_id) == "COMPLETED"
    assert out.read_text().split() == [slurm_cluster.node] * 2


def test_failing_job_is_failed(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    job_id = sbatch(slurm_cluster, tmp_path / "job.out", "--wrap", "exit 3")
    assert slurm_cluster.wait_final_state(job_id) == "FAILED"
    exit_code = slurm_cluster.run(
        "sacct", "-j", job_id, "-X", "--format=ExitCode", "--noheader", "--parsable2"
    )
    assert exit_code.strip() == "3:0"


def test_scancel_is_cancelled(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    job_id = sbatch(slurm_cluster, tmp_path / "job.out", "--wrap", "sleep 300")
    deadline = time.monotonic() + 30
    while slurm_cluster.run("squeue", "--noheader", "--jobs", job_id, "--format=%T").strip() != "RUNNING":
        assert time.monotonic() < deadline, f"job {job_id} did not start within 30 s"
        time.sleep(0.2)
    slurm_cluster.run("scancel", job_id)
    assert slurm_cluster.wait_final_state(job_id) == "CANCELLED"


def test_srun_two_tasks(slurm_cluster: SlurmCluster) -> None:
    out = slurm_cluster.run("srun", "--ntasks=2", "hostname")
    assert out.split() == [slurm_cluster.node] * 2
