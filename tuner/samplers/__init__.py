"""Samplers: grid, random, tpe, gp, nsga2 (optuna), cbo (deephyper), model (ours)."""

from __future__ import annotations

from collections.abc import Sequence

from trainer.contract.parallel import ParallelConfig
from tuner.pricing import Pricing
from tuner.samplers.base import BaseSampler, GridSampler, RandomSampler, Sampler
from tuner.spec import SAMPLERS

__all__ = ["SAMPLERS", "BaseSampler", "Sampler", "make_sampler"]


def make_sampler(
    name: str, candidates: Sequence[ParallelConfig], *, seed: int = 0, pricing: Pricing
) -> BaseSampler:
    """A sampler over `candidates` (the valid layouts), priced by the study's `pricing`. The
    performance model orders `grid`, warm-starts the optuna and deephyper samplers, and drives
    `model`; every sampler hands its estimates back (BaseSampler.estimate)."""
    if name not in SAMPLERS:
        raise ValueError(f"unknown sampler {name!r}; valid: {list(SAMPLERS)}")
    candidates = list(candidates)
    if name == "random":
        return RandomSampler(candidates, seed, pricing=pricing)
    if name == "model":
        from tuner.samplers.model import ModelSampler

        return ModelSampler(candidates, seed, pricing=pricing)
    predicted = [c for c, _ in pricing.rank(candidates)]
    if name == "grid":
        return GridSampler(candidates, seed, pricing=pricing, order=predicted)
    warm = predicted[0] if predicted else None
    if name == "cbo":
        from tuner.samplers.external import CBOSampler

        return CBOSampler(candidates, seed, pricing=pricing, warm_start=warm)
    from tuner.samplers.external import OptunaSampler

    return OptunaSampler(candidates, seed, pricing=pricing, kind=name, warm_start=warm)
