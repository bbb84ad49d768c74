"""The dispatcher seam: where a trial runs, and how its job is named, watched and ended.

Dispatchers submit, poll and cancel jobs and report their states; they never import the runner,
the store or the database (tuner/loop.py is the one writer of trial states). A job is named by a
`JobHandle`, a small typed value stored as text on the trial, from which any later process can
poll or cancel the job again.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, get_args

from trainer.contract.result import BenchmarkConfig
from tuner.outcome import Outcome

Kind = Literal["local", "slurm", "step", "fake"]


@dataclass(frozen=True)
class JobHandle:
    """`<kind>:<id>@<trial work dir>`. ids: a Slurm job id; `<host>/<pid>` of a local trial's
    supervisor (trainer/launch.py); `<allocation>/<host>/<pid>` of an srun step."""

    kind: Kind
    id: str
    work_dir: Path

    def __post_init__(self) -> None:
        if self.kind not in get_args(Kind) or not self.id or "@" in self.id:
            raise ValueError(f"not a job handle: kind {self.kind!r}, id {self.id!r}")

    def __str__(self) -> str:
        return f"{self.kind}:{self.id}@{self.work_dir}"

    @classmethod
    def parse(cls, text: str) -> JobHandle:
        kind, sep, rest = text.partition(":")
        job, at, work_dir = rest.partition("@")
        if not (sep and at and work_dir):
            raise ValueError(f"not a job handle: {text!r} (expected <kind>:<id>@<work dir>)")
        return cls(kind, job, Path(work_dir))  # type: ignore[arg-type]

    @property
    def host(self) -> str | None:
        """The host of a local trial or step; None for a Slurm job."""
        parts = self.id.split("/")
        return parts[-2] if len(parts) >= 2 else None

    @property
    def pid(self) -> int | None:
        parts = self.id.split("/")
        return int(parts[-1]) if len(parts) >= 2 and parts[-1].isdigit() else None

    @property
    def short(self) -> str:
        """What a table shows: the Slurm id, or host/pid."""
        return self.id


@dataclass(frozen=True)
class JobReport:
    """A job's state in its scheduler's words (Slurm's state; RUNNING or ENDED for a process),
    and its outcome once it ended."""

    state: str
    outcome: Outcome | None = None

    @property
    def done(self) -> bool:
        return self.outcome is not None


class DispatchError(RuntimeError):
    """The job could not be submitted (sbatch exited non-zero or timed out, the controller is
    unreachable, the launcher could not start). Not the layout's fault and not the study's: the
    runner re-queues the trial with back-off."""


class Dispatcher(Protocol):
    """Contract (tests/tuner/test_dispatch_contract.py runs it over every implementation):
    `submit` returns a handle or raises DispatchError; `poll` works for any handle this or an
    earlier process submitted, and keeps answering the same report after the job ended; `cancel`
    ends the job (for local processes: returns when none of them is left); `find` returns the
    job submitted under `name` into `work_dir` if there is one (a crash between a submission and
    the commit of its handle)."""

    def can_start(self, cfg: BenchmarkConfig) -> bool:
        """Whether free devices can take this trial now."""

    def submit(self, cfg: BenchmarkConfig, *, name: str, work_dir: Path, timeout_s: float) -> JobHandle: ...

    def poll(self, job: JobHandle) -> JobReport: ...

    def cancel(self, job: JobHandle) -> None: ...

    def find(self, name: str, work_dir: Path) -> JobHandle | None: ...
