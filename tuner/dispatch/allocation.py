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
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from trainer.contract.result import BenchmarkConfig
from trainer.contract.trial_dir import CONFIG_FILE, RESULT_FILE
from tuner.dispatch.base import JobHandle
from tuner.dispatch.local import LocalDispatcher
from tuner.dispatch.sbatch import (
    SRUN_WAIT_S,
    SiteSettings,
    SlurmResources,
    job_name,
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
    """Trials as `srun` steps of the allocation this process runs in (or of `allocation`). Slots:
    each node's devices. A trial that fits on one node is packed onto the fullest node it fits on;
    a larger one takes whole free nodes, so its tensor-parallel groups stay inside nodes
    (trainer/contract/topology.py). Each step names its nodes (`--nodelist`), so placement is decided
    here, not by chance; it runs under a trial supervisor (trainer/launch.py) like a local trial."""

    kind = "step"

    def __init__(self, *, nodes: list[str], devices_per_node: int, gpu: bool, end: float | None,
                 margin_s: float = 60.0, env: dict[str, str] | None = None,
                 python: str = sys.executable, allocation: str | None = None):  # fmt: skip
        if not nodes:
            raise ValueError("an srun dispatcher needs the allocation's node names (allocation_nodes())")
        super().__init__(num_devices=len(nodes) * devices_per_node, gpu=gpu, env=env)
        self.node_names, self.devices_per_node = list(nodes), devices_per_node
        self.end, self.margin_s, self.python = end, margin_s, python
        self.allocation = allocation or os.environ.get("SLURM_JOB_ID", "none")

    def time_left(self) -> float:
        return float("inf") if self.end is None else self.end - time.time()

    def can_start(self, cfg: BenchmarkConfig) -> bool:
        return self.time_left() >= 2 * self.margin_s and super().can_start(cfg)

    def _pick(self, world: int) -> list[int] | None:
        per, free = self.devices_per_node, set(self._free())
        free_on = {
            n: [n * per + i for i in range(per) if n * per + i in free] for n in range(len(self.node_names))
        }
        if world <= per:  # best fit: the node with the fewest free slots that still holds it
            fits = sorted((len(slots), n) for n, slots in free_on.items() if len(slots) >= world)
            return free_on[fits[0][1]][:world] if fits else None
        whole = [n for n, slots in free_on.items() if len(slots) == per][: math.ceil(world / per)]
        if len(whole) * per < world:
            return None
        return [slot for n in whole for slot in free_on[n]][:world]

    def _job_id(self, run) -> str:
        return f"{self.allocation}/{self.host}/{run.pid}"

    def _command(self, cfg: BenchmarkConfig, work_dir: Path, name: str, slots: list[int]) -> list[str]:
        nodes = sorted({s // self.devices_per_node for s in slots})
        per_node = min(cfg.parallel.world_size, self.devices_per_node)
        step = [
            "srun", f"--jobid={self.allocation}", f"--job-name={job_name(name)}",
            f"--nodelist={','.join(self.node_names[n] for n in nodes)}", f"--nodes={len(nodes)}",
            f"--ntasks={cfg.parallel.world_size}", f"--ntasks-per-node={per_node}", "--distribution=block",
            "--cpus-per-task=1", "--exact", "--kill-on-bad-exit=1", f"--wait={SRUN_WAIT_S}",
        ]  # fmt: skip
        if self.gpu:
            step.append("--gpus-per-task=1")
        return [*step, self.python, "-m", "trainer.benchmark", "--config", str(work_dir / CONFIG_FILE),
                "--out", str(work_dir / RESULT_FILE)]  # fmt: skip


def allocation_nodes() -> list[str]:
    """The allocation's node names, in Slurm's order (`scontrol show hostnames`)."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        return []
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                             check=True, timeout=60).stdout  # fmt: skip
    except (subprocess.SubprocessError, OSError):
        return []
    return out.split()


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
