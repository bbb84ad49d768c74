"""Test doubles for the study runner: a fake clock and an in-memory dispatcher whose jobs run on
that clock. A `FakeCluster` holds the jobs, so a new FakeDispatcher over the same cluster is a
restarted worker seeing the jobs the old one left. The same runner code runs against the real
dispatchers in tests/tuner/test_dispatch_contract.py, tests/tuner/test_loop.py and tests/slurm/."""

from __future__ import annotations

import dataclasses
import datetime as dt
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from trainer.contract.result import BenchmarkConfig
from tuner.dispatch import DispatchError, JobHandle, JobReport
from tuner.outcome import FailureKind, Outcome


class FakeClock:
    """Time that moves only when the runner sleeps. A runner still looping after 6 simulated
    hours has lost its way: fail the test instead of hanging it."""

    LIMIT = dt.timedelta(hours=6)

    def __init__(self, start: dt.datetime | None = None):
        self.t = self.start = start or dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)

    def __call__(self) -> dt.datetime:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += dt.timedelta(seconds=seconds)
        if self.t - self.start > self.LIMIT:
            raise RuntimeError("the runner did not finish within 6 simulated hours")


def tokens_for(cfg: BenchmarkConfig) -> float:
    """A deterministic 'measurement': the layout's throughput on the fake cluster."""
    p = cfg.parallel
    return 1000.0 * p.world_size / (1 + 0.1 * p.tp + 0.2 * p.pp) * (1 + 0.01 * p.micro_batch_size)


def ok(cfg: BenchmarkConfig, speed: float = 1.0) -> Outcome:
    tokens = tokens_for(cfg) * speed
    return Outcome(ok=True, tokens_per_s=tokens, step_time_s=cfg.tokens_per_step / tokens, peak_memory_bytes=10**6,
                   result={"step_times_s": [cfg.tokens_per_step / tokens]})  # fmt: skip


def measured_at(speed: Callable[[str], float]) -> Callable[[BenchmarkConfig, str], tuple[float, Outcome]]:
    """A trial that runs 60 s, or stops after 30 s as the trainer does when it is slower than
    the floor it was given (pruned while running: the same tokens/s, measured on fewer steps).
    speed(attempt name) scales the layout's throughput (a node that runs slow)."""

    def script(cfg: BenchmarkConfig, name: str) -> tuple[float, Outcome]:
        floor, outcome = cfg.abandon_below_tokens_per_s, ok(cfg, speed(name))
        if floor is None or outcome.tokens_per_s >= floor:
            return 60.0, outcome
        message = f"pruned while running: {outcome.tokens_per_s:,.0f} tokens/s < floor {floor:,.0f} tokens/s"
        return 30.0, dataclasses.replace(outcome, pruned=True, message=message)

    return script


measured = measured_at(lambda name: 1.0)


@dataclass
class FakeJob:
    name: str
    cfg: BenchmarkConfig
    work_dir: Path
    ends_at: dt.datetime
    outcome: Outcome
    cancelled: bool = False


# script(cfg, attempt_name) -> (seconds it runs, how it ends)
Script = Callable[[BenchmarkConfig, str], tuple[float, Outcome]]


@dataclass
class FakeCluster:
    clock: FakeClock
    script: Script = measured
    capacity: int = 8  # devices
    fail_submit: Callable[[str], str | None] = lambda name: None  # an error message -> DispatchError
    jobs: dict[str, FakeJob] = field(default_factory=dict)
    submitted: list[str] = field(default_factory=list)  # names, in order (attempts included)
    ids: itertools.count = field(default_factory=lambda: itertools.count(1))

    def running(self) -> list[FakeJob]:
        return [j for j in self.jobs.values() if not j.cancelled and j.ends_at > self.clock()]


class FakeDispatcher:
    """The Dispatcher protocol in memory."""

    def __init__(self, cluster: FakeCluster):
        self.cluster = cluster

    def can_start(self, cfg: BenchmarkConfig) -> bool:
        busy = sum(j.cfg.parallel.world_size for j in self.cluster.running())
        return busy + cfg.parallel.world_size <= self.cluster.capacity

    def submit(self, cfg: BenchmarkConfig, *, name: str, work_dir: Path, timeout_s: float) -> JobHandle:
        if (error := self.cluster.fail_submit(name)) is not None:
            raise DispatchError(error)
        seconds, outcome = self.cluster.script(cfg, name)
        if seconds > timeout_s:
            seconds, outcome = (
                timeout_s,
                Outcome.failed(FailureKind.TIMEOUT, f"timed out after {timeout_s:.0f} s"),
            )
        job_id = str(next(self.cluster.ids))
        self.cluster.jobs[job_id] = FakeJob(name, cfg, work_dir, self.cluster.clock() + dt.timedelta(seconds=seconds),
                                            outcome)  # fmt: skip
        self.cluster.submitted.append(name)
        return JobHandle("fake", job_id, work_dir)

    def poll(self, job: JobHandle) -> JobReport:
        j = self.cluster.jobs.get(job.id)
        if j is None:
            return JobReport("LOST", Outcome.failed(FailureKind.INFRA, f"fake job {job.id} is unknown"))
        if j.cancelled:
            return JobReport("CANCELLED", Outcome.failed(FailureKind.CANCELLED, "cancelled"))
        if j.ends_at > self.cluster.clock():
            return JobReport("RUNNING")
        return JobReport("COMPLETED", j.outcome)

    def cancel(self, job: JobHandle) -> None:
        if job.id in self.cluster.jobs:
            self.cluster.jobs[job.id].cancelled = True

    def find(self, name: str, work_dir: Path) -> JobHandle | None:
        found = [i for i, j in self.cluster.jobs.items() if j.name == name]
        return JobHandle("fake", found[-1], work_dir) if found else None
