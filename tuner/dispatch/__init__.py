"""Dispatchers: run a trial somewhere and say how it ended: local process groups (local.py), one
Slurm job per trial (slurm.py), or srun steps inside one Slurm allocation (allocation.py)."""

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


BACKENDS = ("local", "slurm")


def make_dispatcher(spec, backend: str | None = None, env: dict[str, str] | None = None) -> Dispatcher:
    """The dispatcher a study runs on: `backend` (the CLI's --backend) or the spec's."""
    backend = backend or spec.backend
    gpu = spec.trial.device == "cuda"
    if backend == "local":
        from tuner.dispatch.local import LocalDispatcher

        return LocalDispatcher(gpu=gpu, env=env)
    if backend == "slurm":
        from tuner.dispatch.slurm import SiteSettings, SlurmDispatcher

        return SlurmDispatcher(spec=spec.slurm, site=SiteSettings.from_env(),
                               gpus_per_node=spec.cluster.gpus_per_node, gpu=gpu, env=env or {})  # fmt: skip
    raise ValueError(f"unknown backend {backend!r}; valid: {list(BACKENDS)}")
