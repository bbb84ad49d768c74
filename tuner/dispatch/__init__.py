"""Dispatchers: run a trial somewhere and report how its job is doing: local process groups
(local.py), one Slurm job per trial (slurm.py), or srun steps inside one Slurm allocation
(allocation.py). The seam and its value types: base.py."""

from __future__ import annotations

from tuner.dispatch.base import Dispatcher, DispatchError, JobHandle, JobReport

__all__ = [
    "BACKENDS",
    "DispatchError",
    "Dispatcher",
    "JobHandle",
    "JobReport",
    "close_dispatcher",
    "make_dispatcher",
]

BACKENDS = ("local", "slurm")


def make_dispatcher(
    spec, backend: str | None = None, env: dict[str, str] | None = None, site=None
) -> Dispatcher:
    """The dispatcher a study runs on: `backend` (the CLI's --backend) or the spec's. `site`:
    the Slurm site's defaults (tuner.settings: Settings.slurm.site()); none when absent."""
    backend = backend or spec.backend
    if backend == "local":
        from tuner.dispatch.local import LocalDispatcher

        return LocalDispatcher(gpu=spec.device == "cuda", env=env)
    if backend == "slurm":
        from tuner.dispatch.sbatch import SiteSettings
        from tuner.dispatch.slurm import SlurmDispatcher

        return SlurmDispatcher(spec=spec.slurm, site=site or SiteSettings(),
                               gpus_per_node=spec.cluster.gpus_per_node, env=env or {})  # fmt: skip
    raise ValueError(f"unknown backend {backend!r}; valid: {list(BACKENDS)}")


def close_dispatcher(dispatcher: Dispatcher) -> None:
    """Release what a dispatcher holds once its study stops running here (a local one's fork
    server); its jobs in flight go on."""
    if close := getattr(dispatcher, "close", None):
        close()
