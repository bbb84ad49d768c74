"""Samplers: grid, random, tpe, gp, nsga2 (optuna), cbo (deephyper), model (ours)."""

from __future__ import annotations

from collections.abc import Sequence

from trainer.config import GPTConfig, ParallelConfig
from tuner.perfmodel import ModelConstants, estimate
from tuner.samplers.base import BaseSampler, GridSampler, RandomSampler, Sampler
from tuner.spec import SAMPLERS, ClusterSpec

__all__ = ["SAMPLERS", "BaseSampler", "Sampler", "make_sampler"]


def make_sampler(
    name: str,
    candidates: Sequence[ParallelConfig],
    *,
    seed: int = 0,
    model: GPTConfig,
    cluster: ClusterSpec,
    precision: str = "bf16",
    constants: ModelConstants | None = None,
) -> BaseSampler:
    """A sampler over `candidates` (the valid layouts). The performance model orders `grid`,
    warm-starts the optuna and deephyper samplers, and drives `model`."""
    if name not in SAMPLERS:
        raise ValueError(f"unknown sampler {name!r}; valid: {list(SAMPLERS)}")
    candidates = list(candidates)
    if name == "random":
        return RandomSampler(candidates, seed)
    if name == "model":
        from tuner.samplers.model import ModelSampler

        return ModelSampler(
            candidates, seed, model=model, cluster=cluster, precision=precision, constants=constants
        )
    predicted = sorted(
        candidates, key=lambda c: -estimate(model, c, cluster, precision, constants).tokens_per_s
    ) if candidates else []  # fmt: skip
    if name == "grid":
        return GridSampler(candidates, seed, order=predicted)
    warm = predicted[0] if predicted else None
    if name == "cbo":
        from tuner.samplers.external import CBOSampler

        return CBOSampler(candidates, seed, warm_start=warm)
    from tuner.samplers.external import OptunaSampler

    return OptunaSampler(candidates, seed, kind=name, warm_start=warm)
