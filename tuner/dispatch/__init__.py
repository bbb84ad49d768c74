"""Dispatchers: run a trial somewhere and say how it ended (local process groups; Slurm: issue 5)."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from trainer.config import BenchmarkConfig
from tuner.outcome import Outcome


class Dispatcher(Protocol):
    def submit(self, cfg: BenchmarkConfig, *, name: str, work_dir: Path, timeout_s: float) -> str:
        """Start the trial; returns a job id that survives a restart of the caller."""

    def poll(self, job_id: str) -> Outcome | None:
        """None while running; the outcome once finished (a lost job: FailureKind.INFRA)."""

    def cancel(self, job_id: str) -> None: ...

    def can_start(self, cfg: BenchmarkConfig) -> bool:
        """Whether free devices can take this trial now."""
