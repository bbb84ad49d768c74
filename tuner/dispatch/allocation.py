"""Allocation mode: one `sbatch` allocation (N nodes, T minutes) runs a trial runner that pulls a
study's trials one after another, or several side by side when they need fewer devices than the
allocation has, each launched with `srun` as a job step: no queue wait per trial.

    tuner run study.yaml --backend slurm     (with `slurm: {mode: allocation}` in the spec)

submits the allocation (submit_allocation) and follows the study in the database; inside the
allocation `tuner alloc-run STUDY_ID` (run_in_allocation) runs the study loop with an
SrunDispatcher. The runner stops starting trials when less than 2 x `margin_s` is left, and at
`margin_s` before the end it stops the running steps, re-queues their trials (WAITING, not failed)
and hands the study back (PENDING): the next allocation resumes it.
"""

from __future__ import annotations

import datetime as dt
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from trainer.config import BenchmarkConfig, BenchmarkResult
from trainer.launch import CONFIG_FILE, RESULT_FILE, start_local
from tuner.dispatch.local import LocalDispatcher
from tuner.dispatch.slurm import SiteSettings, _job_name, _run, layout_resources, preamble, site_options
from tuner.outcome import FailureKind, Outcome, classify
from tuner.spec import StudySpec, slug

ALLOCATION_SCRIPT = "allocation.sbatch"


def allocation_end(job_id: str) -> float | None:
    """The allocation's end as a time.time() timestamp (squeue's EndTime), or None if unknown."""
    proc = subprocess.run(["squeue", "--noheader", "--format=%e", f"--jobs={job_id}"],
                          capture_output=True, text=True, check=False, timeout=60)  # fmt: skip
    try:
        return dt.datetime.fromisoformat(proc.stdout.strip()).timestamp()
    except ValueError:
        return None


class SrunDispatcher(LocalDispatcher):
    """Trials as `srun` steps of the allocation this process runs in. Devices: the allocation's
    nodes x devices per node, handed out to steps like local device slots."""

    def __init__(self, *, nodes: int, devices_per_node: int, gpu: bool, end: float | None,
                 margin_s: float = 60.0, env: dict[str, str] | None = None,
                 python: str = sys.executable):  # fmt: skip
        super().__init__(num_devices=nodes * devices_per_node, gpu=gpu, env=env)
        self.devices_per_node, self.end, self.margin_s, self.python = devices_per_node, end, margin_s, python
        self.allocation = os.environ.get("SLURM_JOB_ID", "?")

    def time_left(self) -> float:
        return float("inf") if self.end is None else self.end - time.time()

    def can_start(self, cfg: BenchmarkConfig) -> bool:
        if self.time_left() < 2 * self.margin_s:
            return False
        return len(self._free()) >= cfg.parallel.world_size

    def submit(self, cfg: BenchmarkConfig, *, name: str, work_dir: Path, timeout_s: float) -> str:
        ids = self._free()[: cfg.parallel.world_size]
        nodes, per_node = layout_resources(cfg, self.devices_per_node)
        step = ["srun", f"--job-name={_job_name(name)}", f"--nodes={nodes}", f"--ntasks={cfg.parallel.world_size}",
                f"--ntasks-per-node={per_node}", "--cpus-per-task=1", "--exact", "--kill-on-bad-exit=1"]  # fmt: skip
        if self.gpu:
            step.append("--gpus-per-task=1")
        step += [self.python, "-m", "trainer.benchmark", "--config", str(work_dir / CONFIG_FILE),
                 "--out", str(work_dir / RESULT_FILE)]  # fmt: skip
        run = start_local(cfg, work_dir, timeout_s=timeout_s, env=self.env, command=step)
        job = f"step:{self.allocation}:{run.process.pid}@{work_dir}"
        self.runs[job], self.devices[job] = run, ids
        return job

    def poll(self, job_id: str) -> Outcome | None:
        if job_id in self.runs:
            return super().poll(job_id)
        # A step of an earlier allocation: it ended with it. Its result, if it left one.
        work_dir = Path(job_id.partition("@")[2])
        try:
            return classify(BenchmarkResult.from_json((work_dir / RESULT_FILE).read_text()))
        except (OSError, ValueError):
            return Outcome.failed(
                FailureKind.INFRA, f"step {job_id.partition('@')[0]} ended with its allocation"
            )

    def cancel(self, job_id: str) -> None:
        if job_id in self.runs:
            super().cancel(job_id)


def render_allocation_script(study_id: int, spec: StudySpec, site: SiteSettings, env: dict[str, str]) -> str:
    q = shlex.quote
    lines = ["#!/bin/bash", "# parallel-tuner allocation (tuner/dispatch/allocation.py)", "set -u"]
    lines += preamble(spec.slurm, site, env)
    lines.append(f"exec {q(site.python)} -m tuner.cli alloc-run {int(study_id)}")
    return "\n".join(lines) + "\n"


def submit_allocation(study_id: int, spec: StudySpec, work_dir: Path, *, site: SiteSettings,
                      env: dict[str, str]) -> str:  # fmt: skip
    """sbatch the allocation that runs the study; returns the Slurm job id. `env` must carry what
    the runner needs to find the study (TUNER_DATABASE_URL, TUNER_WORK_DIR)."""
    s, c = spec.slurm, spec.cluster
    nodes = s.allocation_nodes or -(-spec.devices // c.gpus_per_node)
    folder = work_dir / slug(spec.name)
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / ALLOCATION_SCRIPT
    script.write_text(render_allocation_script(study_id, spec, site, env))
    args = [
        "sbatch", "--parsable", f"--job-name={_job_name('tuner-' + slug(spec.name))}",
        f"--output={folder / 'allocation-%j.log'}", f"--nodes={nodes}", f"--ntasks-per-node={c.gpus_per_node}",
        f"--time={s.allocation_minutes}", "--no-requeue", f"--chdir={folder}",
    ]  # fmt: skip
    if spec.trial.device == "cuda":
        args.append(f"--gpus-per-node={s.gpus_per_node if s.gpus_per_node is not None else c.gpus_per_node}")
    args += site_options(s, site)
    args.append(str(script))
    return _run(args).strip().split(";")[0]


def run_in_allocation(study_id: int, *, margin_s: float | None = None) -> str:
    """The runner inside the allocation: the study loop over srun steps until the study ends or
    the allocation is about to. Returns the study's status (PENDING when handed back)."""
    from tuner import store
    from tuner.db import connect
    from tuner.loop import run_study
    from tuner.settings import Settings

    settings = Settings.from_env()
    sessions = connect(settings.database_url)
    with sessions() as s:
        study = store.get_study(s, study_id)
        if study is None:
            raise SystemExit(f"no study with id {study_id}")
        spec = StudySpec.model_validate(study.spec)
        name = study.name
    margin_s = margin_s if margin_s is not None else spec.slurm.allocation_margin_s
    job = os.environ.get("SLURM_JOB_ID")
    end = allocation_end(job) if job else None
    dispatcher = SrunDispatcher(
        nodes=int(os.environ.get("SLURM_JOB_NUM_NODES", "1")), devices_per_node=spec.cluster.gpus_per_node,
        gpu=spec.trial.device == "cuda", end=end, margin_s=margin_s,
        env={**spec.slurm.env}, python=sys.executable,
    )  # fmt: skip
    return run_study(sessions, name, dispatcher, settings.work_dir, poll_s=0.5,
                     should_yield=lambda: dispatcher.time_left() < margin_s)  # fmt: skip
