"""Trials as Slurm jobs: one `sbatch` per trial, the trainer under `srun`, one rank per task.

Why not submitit: it pickles a Python callable and runs it once per task; we launch the trainer
module under `srun` with our own rendezvous (trainer/benchmark.py reads SLURM_*), need the same
steps inside one allocation (tuner/dispatch/allocation.py), and want a job's files (config.json,
result.json, log.txt) to be the whole contract so that a restarted worker re-attaches from the job
id alone. Everything a user wrote reaches Slurm either as a validated name (tuner/spec.py:
SlurmSpec) or as one argv element of `sbatch` (no shell), and the job script quotes every value
with shlex.quote. Golden files: tests/slurm/golden/.

Job ids are "<slurm job id>@<trial work dir>". Polling is one `sacct` call (plus one `squeue` for
jobs sacct has not recorded yet) for every watched job per interval; the interval backs off from
1 s to 30 s while nothing changes and drops back when something does.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from trainer.config import BenchmarkConfig, BenchmarkResult
from trainer.launch import CONFIG_FILE, LOG_FILE, RESULT_FILE
from tuner.outcome import FailureKind, Outcome, classify
from tuner.spec import SlurmSpec

ROOT = Path(__file__).resolve().parent.parent.parent
SCRIPT_FILE = "job.sbatch"

# Slurm job states (sacct/squeue) -> what they mean for a trial.
ACTIVE = {"PENDING", "RUNNING", "REQUEUED", "RESIZING", "SUSPENDED", "CONFIGURING", "COMPLETING",
          "STAGE_OUT", "SIGNALING", "REQUEUE_FED", "REQUEUE_HOLD", "SPECIAL_EXIT", "STOPPED",
          "RESV_DEL_HOLD", "UPDATE_DB", "POWER_UP_NODE"}  # fmt: skip
INFRA = {"NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE", "LAUNCH_FAILED", "REVOKED"}
OOM_PATTERNS = re.compile(r"out of memory|OutOfMemoryError|oom[-_ ]kill|OUT_OF_MEMORY", re.IGNORECASE)
LOST_AFTER_S = 300.0  # a job neither sacct nor squeue knows for this long is lost


@dataclass(frozen=True)
class SiteSettings:
    """A site's Slurm defaults (settings, TUNER_SLURM_*); the study's SlurmSpec overrides them.
    `setup` is shell code run at the top of every job (e.g. `source /opt/site/env.sh`): an
    administrator's setting, never taken from a submitted spec."""

    account: str | None = None
    partition: str | None = None
    qos: str | None = None
    constraint: str | None = None
    setup: tuple[str, ...] = ()
    python: str = sys.executable  # the interpreter on the compute nodes (same path on a shared FS)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> SiteSettings:
        env = os.environ if environ is None else environ
        setup_file = env.get("TUNER_SLURM_SETUP")
        setup = tuple(Path(setup_file).read_text().splitlines()) if setup_file else ()
        # The names go through the same checks as a spec's.
        names = SlurmSpec(
            account=env.get("TUNER_SLURM_ACCOUNT") or None, partition=env.get("TUNER_SLURM_PARTITION") or None,
            qos=env.get("TUNER_SLURM_QOS") or None, constraint=env.get("TUNER_SLURM_CONSTRAINT") or None,
        )  # fmt: skip
        return cls(names.account, names.partition, names.qos, names.constraint, setup,
                   env.get("TUNER_SLURM_PYTHON") or sys.executable)  # fmt: skip


def time_limit_minutes(timeout_s: float) -> int:
    """Slurm's --time for a trial: its timeout (start-up included) in whole minutes, at least 1.
    Slurm enforces limits every 30 s, so a trial ends TIMEOUT up to ~30 s after it."""
    return max(1, math.ceil(timeout_s / 60))


def layout_resources(cfg: BenchmarkConfig, gpus_per_node: int) -> tuple[int, int]:
    """(nodes, tasks per node): one task per rank, ranks packed onto as few nodes as possible."""
    world = cfg.parallel.world_size
    per_node = max(1, min(world, gpus_per_node))
    return math.ceil(world / per_node), per_node


def sbatch_args(
    cfg: BenchmarkConfig, *, name: str, work_dir: Path, timeout_s: float, spec: SlurmSpec,
    site: SiteSettings, gpus_per_node: int, gpu: bool,
) -> list[str]:  # fmt: skip
    """The `sbatch` argv (no shell): resources, time limit, site options, the script path."""
    nodes, per_node = layout_resources(cfg, gpus_per_node)
    args = [
        "sbatch", "--parsable", f"--job-name={_job_name(name)}", f"--output={work_dir / LOG_FILE}",
        "--open-mode=append", f"--nodes={nodes}", f"--ntasks-per-node={per_node}",
        f"--ntasks={cfg.parallel.world_size}", f"--time={time_limit_minutes(timeout_s)}", "--no-requeue",
        f"--chdir={work_dir}",
    ]  # fmt: skip
    if gpu:
        args.append(f"--gpus-per-node={spec.gpus_per_node if spec.gpus_per_node is not None else per_node}")
    if spec.cpus_per_task:
        args.append(f"--cpus-per-task={spec.cpus_per_task}")
    args += site_options(spec, site)
    args.append(str(work_dir / SCRIPT_FILE))
    return args


SITE_OPTIONS = ("account", "partition", "qos", "constraint")


def site_options(spec: SlurmSpec, site: SiteSettings) -> list[str]:
    """`--account=...` etc.: the spec's value, else the site's; validated names only."""
    return [f"--{o}={v}" for o in SITE_OPTIONS if (v := getattr(spec, o) or getattr(site, o))]


def preamble(spec: SlurmSpec, site: SiteSettings, env: dict[str, str]) -> list[str]:
    """Job-script lines before the command: site setup, module loads, this checkout on
    PYTHONPATH, the exports (`env`, then the spec's; values quoted)."""
    q = shlex.quote
    return [
        *site.setup, *[f"module load {q(m)}" for m in spec.modules],
        f"export PYTHONPATH={q(str(ROOT))}" + "${PYTHONPATH:+:$PYTHONPATH}",
        *[f"export {k}={q(v)}" for k, v in sorted({**env, **spec.env}.items())],
    ]  # fmt: skip


def render_script(cfg: BenchmarkConfig, *, work_dir: Path, spec: SlurmSpec, site: SiteSettings,
                  env: dict[str, str]) -> str:  # fmt: skip
    """The job script: site setup, modules, environment, then the trainer under srun."""
    q = shlex.quote
    lines = [
        "#!/bin/bash",
        "# parallel-tuner trial (tuner/dispatch/slurm.py); resources are sbatch options",
        "set -u",
    ]
    lines += preamble(spec, site, env)
    lines.append(f"cd {q(str(work_dir))}")
    lines.append(
        f"exec srun --kill-on-bad-exit=1 {q(site.python)} -m trainer.benchmark "
        f"--config {q(str(work_dir / CONFIG_FILE))} --out {q(str(work_dir / RESULT_FILE))}"
    )
    return "\n".join(lines) + "\n"


def _job_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:100] or "trial"


@dataclass
class _Watch:
    work_dir: Path
    since: float
    state: str = "PENDING"
    exit_code: str = ""


@dataclass
class SlurmDispatcher:
    """The Dispatcher protocol over sbatch/sacct/squeue/scancel."""

    spec: SlurmSpec = field(default_factory=SlurmSpec)
    site: SiteSettings = field(default_factory=SiteSettings)
    gpus_per_node: int = 1
    gpu: bool = False
    env: dict[str, str] = field(default_factory=dict)  # exported in every job
    min_interval_s: float = 1.0
    max_interval_s: float = 30.0

    def __post_init__(self) -> None:
        self.watched: dict[str, _Watch] = {}
        self.final: dict[str, str] = {}  # job -> the state it ended in
        self.cancelled: set[str] = set()
        self.interval = self.min_interval_s
        self.next_poll = 0.0
        self.polls = 0  # sacct calls made, for the tests and the benchmark

    # --- the protocol ---

    def can_start(self, cfg: BenchmarkConfig) -> bool:
        return True  # Slurm queues; the study's trials_in_flight bounds what we submit

    def submit(self, cfg: BenchmarkConfig, *, name: str, work_dir: Path, timeout_s: float) -> str:
        work_dir.mkdir(parents=True, exist_ok=True)
        (work_dir / CONFIG_FILE).write_text(cfg.to_json())
        (work_dir / RESULT_FILE).unlink(missing_ok=True)
        (work_dir / SCRIPT_FILE).write_text(render_script(cfg, work_dir=work_dir, spec=self.spec,
                                                          site=self.site, env=self.env))  # fmt: skip
        args = sbatch_args(cfg, name=name, work_dir=work_dir, timeout_s=timeout_s, spec=self.spec,
                           site=self.site, gpus_per_node=self.gpus_per_node, gpu=self.gpu)  # fmt: skip
        out = _run(args)
        slurm_id = out.strip().split(";")[0]
        if not slurm_id.isdigit():
            raise RuntimeError(f"sbatch printed {out!r}, not a job id")
        job = f"{slurm_id}@{work_dir}"
        self.watched[slurm_id] = _Watch(work_dir, time.monotonic())
        self.interval, self.next_poll = self.min_interval_s, 0.0
        return job

    def poll(self, job_id: str) -> Outcome | None:
        slurm_id, work_dir = _parse(job_id)
        if slurm_id not in self.watched:  # re-attached after a restart
            self.watched[slurm_id] = _Watch(work_dir, time.monotonic())
            self.next_poll = 0.0
        if time.monotonic() >= self.next_poll:
            self._refresh()
        w = self.watched[slurm_id]
        if w.state in ACTIVE:
            if (
                w.state == "PENDING"
                and time.monotonic() - w.since > LOST_AFTER_S
                and not self._known(slurm_id)
            ):
                self.watched.pop(slurm_id)
                return Outcome.failed(
                    FailureKind.INFRA, f"Slurm job {slurm_id} is unknown to sacct and squeue"
                )
            return None
        self.watched.pop(slurm_id)
        self.final[slurm_id] = w.state
        return self._outcome(slurm_id, w)

    def state(self, job_id: str) -> str | None:
        """The job's last seen Slurm state (for `tuner trials`)."""
        slurm_id = _parse(job_id)[0]
        w = self.watched.get(slurm_id)
        return w.state if w else self.final.get(slurm_id)

    def cancel(self, job_id: str) -> None:
        slurm_id, _ = _parse(job_id)
        self.cancelled.add(slurm_id)
        subprocess.run(["scancel", slurm_id], capture_output=True, text=True, check=False)
        self.watched.pop(slurm_id, None)

    # --- internals ---

    def _refresh(self) -> None:
        ids = sorted(self.watched)
        if not ids:
            return
        states = sacct_states(ids)
        self.polls += 1
        missing = [i for i in ids if i not in states]
        if missing:
            states.update(squeue_states(missing))
        changed = False
        for i, (state, code) in states.items():
            w = self.watched.get(i)
            if w is not None and (w.state, w.exit_code) != (state, code):
                w.state, w.exit_code, changed = state, code, True
        self.interval = self.min_interval_s if changed else min(self.interval * 1.5, self.max_interval_s)
        self.next_poll = time.monotonic() + self.interval

    def _known(self, slurm_id: str) -> bool:
        return bool(squeue_states([slurm_id]) or sacct_states([slurm_id]))

    def _outcome(self, slurm_id: str, w: _Watch) -> Outcome:
        result = _read_result(w.work_dir)
        state = w.state
        if state in INFRA:
            return Outcome.failed(
                FailureKind.INFRA, f"Slurm job {slurm_id} ended {state}: not the layout's fault"
            )
        if state == "TIMEOUT":
            return Outcome.failed(FailureKind.TIMEOUT, f"Slurm job {slurm_id} hit its time limit (TIMEOUT)")
        if state == "CANCELLED":
            who = "the tuner" if slurm_id in self.cancelled else "someone outside the tuner (scancel)"
            return Outcome.failed(FailureKind.CANCELLED, f"Slurm job {slurm_id} was cancelled by {who}")
        if result is not None:  # COMPLETED, or FAILED after the trainer wrote its verdict
            return classify(result)
        tail = _log_tail(w.work_dir)
        if state == "OUT_OF_MEMORY" or OOM_PATTERNS.search(tail):
            return Outcome.failed(
                FailureKind.OOM, f"Slurm job {slurm_id} ran out of memory ({state})\n{tail}"
            )
        return Outcome.failed(
            FailureKind.CRASH,
            f"Slurm job {slurm_id} ended {state} (exit {w.exit_code}) without a result\n{tail}",
        )


def _parse(job_id: str) -> tuple[str, Path]:
    slurm_id, _, work_dir = job_id.partition("@")
    return slurm_id, Path(work_dir)


def _read_result(work_dir: Path) -> BenchmarkResult | None:
    try:
        return BenchmarkResult.from_json((work_dir / RESULT_FILE).read_text())
    except (OSError, ValueError):
        return None


def _log_tail(work_dir: Path, chars: int = 3000) -> str:
    try:
        return (work_dir / LOG_FILE).read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def _run(args: Sequence[str]) -> str:
    proc = subprocess.run(list(args), capture_output=True, text=True, check=False, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"{args[0]} failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    return proc.stdout


def sacct_states(ids: Sequence[str]) -> dict[str, tuple[str, str]]:
    """{job id: (state, exit code)} for the jobs' allocations, in one sacct call."""
    proc = subprocess.run(
        ["sacct", "--allocations", "--noheader", "--parsable2", "--format=JobIDRaw,State,ExitCode",
         f"--jobs={','.join(ids)}"], capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    out: dict[str, tuple[str, str]] = {}
    if proc.returncode != 0:
        return out
    for line in proc.stdout.splitlines():
        parts = line.split("|")
        if len(parts) >= 3 and parts[0] in ids:
            out[parts[0]] = (parts[1].split()[0], parts[2])  # "CANCELLED by 0" -> CANCELLED
    return out


def squeue_states(ids: Sequence[str]) -> dict[str, tuple[str, str]]:
    proc = subprocess.run(
        ["squeue", "--noheader", "--format=%i|%T", f"--jobs={','.join(ids)}"],
        capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    out: dict[str, tuple[str, str]] = {}
    for line in proc.stdout.splitlines():
        job, _, state = line.strip().partition("|")
        if job in ids:
            out[job] = (state, "")
    return out
