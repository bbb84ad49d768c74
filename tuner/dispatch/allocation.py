"""Allocation mode: one `sbatch` allocation (N nodes, T minutes) runs a study runner that pulls
the study's trials one after another, or several side by side when they need fewer devices than
the allocation has, each launched with `srun` as a job step: no queue wait per trial.

    tuner run study.yaml --backend slurm     (with `slurm: {mode: allocation}` in the spec)

submits the allocation (`submit_allocation`) and follows it (tuner/worker.py:
follow_allocations); inside it `tuner alloc-run STUDY_ID` (tuner/worker.py: run_in_allocation)
runs the study with an `SrunDispatcher`. This module only submits and runs jobs and steps.
"""

from __future__ import annotations

import datetime as dt
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from trainer.config import BenchmarkConfig
from trainer.launch import CONFIG_FILE, RESULT_FILE
from tuner.dispatch.base import JobHandle
from tuner.dispatch.local import LocalDispatcher
from tuner.dispatch.sbatch import (
    SiteSettings,
    SlurmResources,
    job_name,
    layout_resources,
    preamble,
    site_options,
)
from tuner.dispatch.slurm import sbatch
from tuner.spec import StudySpec, slug

ALLOCATION_SCRIPT = "allocation.sbatch"


def allocation_end(job_id: str) -> float | None:
    """The allocation's end as a time.time() timestamp (squeue's EndTime), or None if unknown."""
    try:
        proc = subprocess.run(["squeue", "--noheader", "--format=%e", f"--jobs={job_id}"],
                              capture_output=True, text=True, check=False, timeout=60)  # fmt: skip
        return dt.datetime.fromisoformat(proc.stdout.strip()).timestamp()
    except (ValueError, subprocess.TimeoutExpired, OSError):
        return None


class SrunDispatcher(LocalDispatcher):
    """Trials as `srun` steps of the allocation this process runs in (or of SLURM_JOB_ID in
    `env`). Devices: the allocation's nodes x devices per node, handed out to steps like local
    device slots. Each step runs under a trial supervisor (trainer/launch.py), as local trials do."""

    kind = "step"

    def __init__(self, *, nodes: int, devices_per_node: int, gpu: bool, end: float | None,
                 margin_s: float = 60.0, env: dict[str, str] | None = None,
                 python: str = sys.executable, allocation: str | None = None):  # fmt: skip
        super().__init__(num_devices=nodes * devices_per_node, gpu=gpu, env=env)
        self.devices_per_node, self.end, self.margin_s, self.python = devices_per_node, end, margin_s, python
        self.allocation = allocation or os.environ.get("SLURM_JOB_ID", "none")

    def time_left(self) -> float:
        return float("inf") if self.end is None else self.end - time.time()

    def can_start(self, cfg: BenchmarkConfig) -> bool:
        if self.time_left() < 2 * self.margin_s:
            return False
        return len(self._free()) >= cfg.parallel.world_size

    def _job_id(self, run) -> str:
        return f"{self.allocation}/{self.host}/{run.pid}"

    def _command(self, cfg: BenchmarkConfig, work_dir: Path, name: str) -> list[str]:
        nodes, per_node = layout_resources(cfg, self.devices_per_node)
        step = [
            "srun", f"--jobid={self.allocation}", f"--job-name={job_name(name)}", f"--nodes={nodes}",
            f"--ntasks={cfg.parallel.world_size}", f"--ntasks-per-node={per_node}", "--cpus-per-task=1", "--exact",
            "--kill-on-bad-exit=1",
        ]  # fmt: skip
        if self.gpu:
            step.append("--gpus-per-task=1")
        return [*step, self.python, "-m", "trainer.benchmark", "--config", str(work_dir / CONFIG_FILE),
                "--out", str(work_dir / RESULT_FILE)]  # fmt: skip


def render_allocation_script(study_id: int, spec: StudySpec, site: SiteSettings, env: dict[str, str]) -> str:
    q = shlex.quote
    lines = ["#!/bin/bash", "# parallel-tuner allocation (tuner/dispatch/allocation.py)", "set -u"]
    lines += preamble(spec.slurm, site, env)
    lines.append(f"exec {q(site.python)} -m tuner.cli alloc-run {int(study_id)}")
    return "\n".join(lines) + "\n"


def allocation_resources(spec: StudySpec, site: SiteSettings, folder: Path) -> SlurmResources:
    s, c = spec.slurm, spec.cluster
    gpus = (
        (s.gpus_per_node if s.gpus_per_node is not None else c.gpus_per_node)
        if spec.device == "cuda"
        else None
    )
    return SlurmResources(
        name=job_name("tuner-" + slug(spec.name)), nodes=s.allocation_nodes or -(-spec.devices // c.gpus_per_node),
        ntasks_per_node=c.gpus_per_node, time_minutes=s.allocation_minutes, gpus_per_node=gpus,
        site=tuple(site_options(s, site)), output=str(folder / "allocation-%j.log"), chdir=folder,
    )  # fmt: skip


def submit_allocation(study_id: int, spec: StudySpec, work_dir: Path, *, site: SiteSettings,
                      env: dict[str, str]) -> JobHandle:  # fmt: skip
    """sbatch the allocation that runs the study. `env` must carry what the runner needs to find
    the study (TUNER_DATABASE_URL, TUNER_WORK_DIR). Raises DispatchError."""
    folder = work_dir / slug(spec.name)
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / ALLOCATION_SCRIPT
    script.write_text(render_allocation_script(study_id, spec, site, env))
    return JobHandle("slurm", sbatch(allocation_resources(spec, site, folder).argv(script)), folder)
