"""Trials as Slurm jobs: one `sbatch` per trial, the trainer under `srun`, one rank per task.

Why not submitit: it pickles a Python callable and runs it once per task; we launch the trainer
module under `srun` with our own rendezvous (trainer/benchmark.py reads SLURM_*), need the same
steps inside one allocation (tuner/dispatch/allocation.py), and want a job's files (config.json,
result.json, log.txt: trainer/contract/trial_dir.py) to be the whole contract so that a restarted worker
re-attaches from the job handle alone. What reaches sbatch: tuner/dispatch/sbatch.py. Golden
files: tests/slurm/golden/.

Polling is one `sacct` call (plus one `squeue` for jobs sacct has not recorded yet) for every
watched job per interval; the interval backs off (x1.5 per quiet poll, tuner/backoff.py) from 1 s
to 30 s while nothing changes and drops back when something does. A job is named after its trial
attempt, so `find()` can look it up again (squeue, then sacct) when a worker died between `sbatch`
and storing the job id.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from trainer.contract.result import BenchmarkConfig
from trainer.contract.trial_dir import (
    LOG_FILE,
    SCRIPT_FILE,
    TAG_VAR,
    log_tail,
    prepare,
    read_result,
    trial_tag,
)
from tuner.backoff import Backoff
from tuner.dispatch.base import DispatchError, JobHandle, JobReport
from tuner.dispatch.sbatch import SiteSettings, SlurmResources, job_name, render_script
from tuner.outcome import FailureKind, Outcome, classify
from tuner.spec import SlurmSpec

# Slurm job states (sacct/squeue) -> what they mean for a trial.
ACTIVE = {"PENDING", "RUNNING", "REQUEUED", "RESIZING", "SUSPENDED", "CONFIGURING", "COMPLETING",
          "STAGE_OUT", "SIGNALING", "REQUEUE_FED", "REQUEUE_HOLD", "SPECIAL_EXIT", "STOPPED",
          "RESV_DEL_HOLD", "UPDATE_DB", "POWER_UP_NODE"}  # fmt: skip
INFRA = {"NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE", "LAUNCH_FAILED", "REVOKED"}
OOM_PATTERNS = re.compile(r"out of memory|OutOfMemoryError|oom[-_ ]kill|OUT_OF_MEMORY", re.IGNORECASE)
LOST_AFTER_S = 300.0  # a job neither sacct nor squeue knows for this long is lost
# A node Slurm no longer hears from ("idle*", "DOWN", "NOT_RESPONDING") or has failed.
NODE_TROUBLE = re.compile(r"\*|DOWN|FAIL|NOT_RESPONDING|NO_RESPOND", re.IGNORECASE)
# What ranks and srun say when the network between them goes (gloo, NCCL, c10d's store, srun).
NETWORK_ERRORS = re.compile(
    r"Connection (reset|closed|refused)|Broken pipe|No route to host|Network is unreachable|Socket Timeout"
    r"|DistNetworkError|network error|Communication connection failure|Node failure|Socket timed out",
    re.IGNORECASE,
)
NODE_CHECK_EVERY_S = 2.0  # how often a held crash asks Slurm about its nodes
SUBMIT_TIMEOUT_S = 60.0  # sbatch waits for the controller; past this the submission failed


@dataclass
class _Watch:
    work_dir: Path
    since: float
    state: str = "PENDING"
    exit_code: str = ""
    ended: float | None = None  # when a crash was first seen, while its nodes are being watched
    nodes: tuple[str, int] | None = None  # (sacct's NodeList, its node count), once asked
    checked: float = 0.0  # the last look at those nodes


@dataclass
class SlurmDispatcher:
    """The Dispatcher protocol over sbatch/sacct/squeue/scancel."""

    spec: SlurmSpec = field(default_factory=SlurmSpec)
    site: SiteSettings = field(default_factory=SiteSettings)
    gpus_per_node: int = 1
    env: dict[str, str] = field(default_factory=dict)  # exported in every job
    min_interval_s: float = 1.0
    max_interval_s: float = 30.0
    # How long a multi-node crash waits for Slurm to notice a lost node before it stands as the
    # layout's crash; None: 3 x the cluster's SlurmdTimeout (slurmctld flags a node it cannot ping
    # within about one), at most 300 s.
    node_loss_wait_s: float | None = None

    def __post_init__(self) -> None:
        self.watched: dict[str, _Watch] = {}
        self.final: dict[str, JobReport] = {}  # slurm id -> the report it ended with
        self.cancelled: set[str] = set()
        self.backoff = Backoff(self.min_interval_s, self.max_interval_s, factor=1.5)
        self.quiet = 0  # polls in a row that changed nothing
        self.interval = self.backoff.delay(1)
        self.next_poll = 0.0
        self.polls = 0  # sacct calls made, for the tests and the benchmark

    # --- the protocol ---

    def can_start(self, cfg: BenchmarkConfig) -> bool:
        return True  # Slurm queues; the study's trials_in_flight bounds what we submit

    def submit(self, cfg: BenchmarkConfig, *, name: str, work_dir: Path, timeout_s: float) -> JobHandle:
        prepare(work_dir, cfg)
        # Every process of the trial carries its tag, as local trials do (trainer/launch.py).
        env = {**self.env, TAG_VAR: trial_tag(name, work_dir)}
        (work_dir / SCRIPT_FILE).write_text(render_script(cfg, work_dir=work_dir, spec=self.spec,
                                                          site=self.site, env=env))  # fmt: skip
        resources = SlurmResources.for_trial(cfg, name=name, timeout_s=timeout_s, spec=self.spec, site=self.site,
                                             gpus_per_node=self.gpus_per_node, output=str(work_dir / LOG_FILE),
                                             chdir=work_dir)  # fmt: skip
        slurm_id = sbatch(resources.argv(work_dir / SCRIPT_FILE))
        self.watched[slurm_id] = _Watch(work_dir, time.monotonic())
        self.quiet, self.next_poll = 0, 0.0
        self.interval = self.backoff.delay(1)
        return JobHandle("slurm", slurm_id, work_dir)

    def poll(self, job: JobHandle) -> JobReport:
        slurm_id = job.id
        if slurm_id in self.final:
            return self.final[slurm_id]
        if slurm_id not in self.watched:  # re-attached after a restart
            self.watched[slurm_id] = _Watch(job.work_dir, time.monotonic())
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
                return self._end(slurm_id, JobReport("UNKNOWN", Outcome.failed(
                    FailureKind.INFRA, f"Slurm job {slurm_id} is unknown to sacct and squeue")))  # fmt: skip
            return JobReport(w.state)
        outcome = self._outcome(slurm_id, w)
        if outcome.failure is FailureKind.CRASH:
            outcome = self._node_lost(slurm_id, w, outcome)
            if outcome is None:  # Slurm may not have noticed a lost node yet
                return JobReport(w.state)
        return self._end(slurm_id, JobReport(w.state, outcome))

    def cancel(self, job: JobHandle) -> None:
        self.cancelled.add(job.id)
        subprocess.run(["scancel", job.id], capture_output=True, text=True, check=False, timeout=60)
        self.watched.pop(job.id, None)

    def find(self, name: str, work_dir: Path) -> JobHandle | None:
        """The job submitted under `name` (squeue for queued or running ones, else sacct)."""
        ids = squeue_ids_by_name(job_name(name)) or sacct_ids_by_name(job_name(name))
        return JobHandle("slurm", ids[-1], work_dir) if ids else None

    # --- internals ---

    def _end(self, slurm_id: str, report: JobReport) -> JobReport:
        self.watched.pop(slurm_id, None)
        self.final[slurm_id] = report
        return report

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
        self.quiet = 0 if changed else self.quiet + 1
        self.interval = self.backoff.delay(self.quiet + 1)
        self.next_poll = time.monotonic() + self.interval

    def _node_lost(self, slurm_id: str, w: _Watch, crash: Outcome) -> Outcome | None:
        """A multi-node job that crashed without its trainer's verdict, or with a network error,
        may have lost a node: its ranks (or srun) can see a cut link before slurmctld does, and
        the job then ends FAILED, not NODE_FAIL. Such a crash is held until Slurm flags one of the
        job's nodes (then it is INFRA: retried elsewhere, not told to the sampler) or
        `node_loss_wait_s` passes (then it stands). None while held."""
        if w.nodes is None:
            w.nodes = sacct_nodes(slurm_id)
        nodelist, count = w.nodes
        if count <= 1 or not (crash.result == {} or NETWORK_ERRORS.search(crash.message)):
            return crash
        now = time.monotonic()
        if w.ended is None:
            w.ended = now
        elif now - w.checked < NODE_CHECK_EVERY_S and now - w.ended < self._node_loss_wait():
            return None
        w.checked = now
        troubled = {n: st for n, st in node_states(nodelist).items() if NODE_TROUBLE.search(st)}
        if troubled:
            which = ", ".join(f"{n} ({st})" for n, st in sorted(troubled.items()))
            return Outcome.failed(FailureKind.INFRA, f"Slurm job {slurm_id} ended {w.state} and lost "
                                  f"{which}: not the layout's fault\n{crash.message}", crash.result)  # fmt: skip
        return None if now - w.ended < self._node_loss_wait() else crash

    def _node_loss_wait(self) -> float:
        if self.node_loss_wait_s is None:
            found = re.search(r"^SlurmdTimeout\s*=\s*(\d+)", _query(["scontrol", "show", "config"]), re.M)
            self.node_loss_wait_s = min(3.0 * int(found.group(1)), 300.0) if found else 300.0
        return self.node_loss_wait_s

    def _known(self, slurm_id: str) -> bool:
        return bool(squeue_states([slurm_id]) or sacct_states([slurm_id]))

    def _outcome(self, slurm_id: str, w: _Watch) -> Outcome:
        result = read_result(w.work_dir)
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
        tail = log_tail(w.work_dir)
        if state == "OUT_OF_MEMORY" or OOM_PATTERNS.search(tail):
            return Outcome.failed(
                FailureKind.OOM, f"Slurm job {slurm_id} ran out of memory ({state})\n{tail}"
            )
        return Outcome.failed(
            FailureKind.CRASH,
            f"Slurm job {slurm_id} ended {state} (exit {w.exit_code}) without a result\n{tail}",
        )


def sbatch(args: Sequence[str], timeout_s: float = SUBMIT_TIMEOUT_S) -> str:
    """Run `sbatch --parsable ...`; the job id, or DispatchError saying what went wrong."""
    try:
        proc = subprocess.run(list(args), capture_output=True, text=True, check=False, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise DispatchError(
            f"sbatch did not answer within {timeout_s:.0f} s (controller unreachable?)"
        ) from None
    except OSError as e:
        raise DispatchError(f"cannot run sbatch: {e}") from None
    if proc.returncode != 0:
        raise DispatchError(f"sbatch failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    slurm_id = proc.stdout.strip().split(";")[0]
    if not slurm_id.isdigit():
        raise DispatchError(f"sbatch printed {proc.stdout.strip()[:200]!r}, not a job id")
    return slurm_id


def _query(args: list[str]) -> str:
    """A read-only Slurm query; '' when the controller or slurmdbd does not answer."""
    try:
        proc = subprocess.run(args, capture_output=True, text=True, check=False, timeout=60)
    except (subprocess.TimeoutExpired, OSError):
        return ""
    return proc.stdout if proc.returncode == 0 else ""


def sacct_states(ids: Sequence[str]) -> dict[str, tuple[str, str]]:
    """{job id: (state, exit code)} for the jobs' allocations, in one sacct call."""
    out: dict[str, tuple[str, str]] = {}
    text = _query(["sacct", "--allocations", "--noheader", "--parsable2", "--format=JobIDRaw,State,ExitCode",
                   f"--jobs={','.join(ids)}"])  # fmt: skip
    for line in text.splitlines():
        parts = line.split("|")
        if len(parts) >= 3 and parts[0] in ids:
            out[parts[0]] = (parts[1].split()[0], parts[2])  # "CANCELLED by 0" -> CANCELLED
    return out


def sacct_nodes(slurm_id: str) -> tuple[str, int]:
    """The job's allocated nodes as sacct records them: (hostlist, count); ("", 0) if unknown."""
    text = _query(["sacct", "--allocations", "--noheader", "--parsable2", "--format=NodeList,NNodes",
                   f"--jobs={slurm_id}"])  # fmt: skip
    for line in text.splitlines():
        nodelist, _, count = line.strip().partition("|")
        if count.isdigit():
            return nodelist, int(count)
    return "", 0


def node_states(nodelist: str) -> dict[str, str]:
    """{node: sinfo's state} ("idle", "idle*" for one not responding, "down*", ...)."""
    out: dict[str, str] = {}
    for line in _query(
        ["sinfo", "--noheader", "--Node", f"--nodes={nodelist}", "--format=%N|%T"]
    ).splitlines():
        node, _, state = line.strip().partition("|")
        if node and state:
            out[node] = state
    return out


def squeue_states(ids: Sequence[str]) -> dict[str, tuple[str, str]]:
    out: dict[str, tuple[str, str]] = {}
    for line in _query(["squeue", "--noheader", "--format=%i|%T", f"--jobs={','.join(ids)}"]).splitlines():
        job, _, state = line.strip().partition("|")
        if job in ids:
            out[job] = (state, "")
    return out


def squeue_ids_by_name(name: str) -> list[str]:
    text = _query(["squeue", "--noheader", "--format=%i", f"--name={name}"])
    return sorted((i.strip() for i in text.split() if i.strip().isdigit()), key=int)


def sacct_ids_by_name(name: str) -> list[str]:
    # sacct's default window starts at midnight: look back a week.
    text = _query(["sacct", "--allocations", "--noheader", "--parsable2", "--format=JobIDRaw",
                   f"--name={name}", "--starttime=now-7days"])  # fmt: skip
    return sorted((i.strip() for i in text.split() if i.strip().isdigit()), key=int)
