"""The sampler seam: ask() a layout, tell() its outcome. Samplers are caches of the database:
`replay()` rebuilds one from a study's trials after a restart. What a sampler learns from an
outcome is decided in one place, tuner/outcome.py: feedback() -> a score, an infeasible layout,
or nothing (infrastructure failures and cancellations are never held against a layout)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from trainer.contract.parallel import ParallelConfig
from tuner.outcome import Feedback, Outcome, feedback

if TYPE_CHECKING:
    from tuner.cost.terms import Estimate
    from tuner.pricing import Pricing


class Sampler(Protocol):
    name: str

    def ask(self) -> ParallelConfig | None:
        """The next layout to run; None when every valid layout has been proposed."""

    def tell(self, config: ParallelConfig, outcome: Outcome) -> None:
        """How the trial of `config` ended; the sampler acts on feedback(outcome)."""

    def replay(self, config: ParallelConfig, outcome: Outcome | None) -> None:
        """A trial from the database: finished (outcome) or still pending (None)."""

    def estimate(self, config: ParallelConfig) -> Estimate:
        """The estimate the sampler priced `config` with when it proposed it (the runner stores and
        prunes by it; it is not priced again)."""


class BaseSampler:
    """Keeps the candidates, what was proposed, and what was measured; subclasses pick."""

    name = "base"

    def __init__(
        self, candidates: Sequence[ParallelConfig], seed: int = 0, *, pricing: Pricing | None = None
    ):
        self.candidates = list(candidates)
        self.seed = seed
        self.pricing = pricing  # the study's (tuner.pricing); None only for samplers that never price
        self.rng = random.Random(seed)
        self.seen: set[ParallelConfig] = set()
        self.history: list[tuple[ParallelConfig, Outcome]] = []

    def remaining(self) -> list[ParallelConfig]:
        return [c for c in self.candidates if c not in self.seen]

    def ask(self) -> ParallelConfig | None:
        if len(self.seen) >= len(self.candidates) and not self.remaining():
            return None
        config = self._propose()
        if config is None or config in self.seen:  # a subclass that could not choose: fall back
            left = self.remaining()
            config = self.rng.choice(left) if left else None
        if config is not None:
            self.seen.add(config)
        return config

    def tell(self, config: ParallelConfig, outcome: Outcome) -> None:
        self.seen.add(config)
        told = feedback(outcome)
        if told is not Feedback.NOTHING:
            self.history.append((config, outcome))
        self._observe(config, outcome, told)

    def replay(self, config: ParallelConfig, outcome: Outcome | None) -> None:
        self.seen.add(config)
        if outcome is not None:
            self.tell(config, outcome)

    def estimate(self, config: ParallelConfig) -> Estimate:
        if self.pricing is None:
            raise ValueError(f"sampler {self.name!r} was made without a pricing: it cannot estimate layouts")
        return self.pricing.estimate(config)  # memoised: what ranking the space already priced

    def _propose(self) -> ParallelConfig | None:
        raise NotImplementedError

    def _observe(self, config: ParallelConfig, outcome: Outcome, told: Feedback) -> None:
        """Learn from a trial: its score, or that it is infeasible; NOTHING: only forget any
        pending state kept for it (the layout is never proposed again either way)."""


class GridSampler(BaseSampler):
    """Every layout once, in the given order (the model's predicted order, or the space's)."""

    name = "grid"

    def __init__(
        self,
        candidates: Sequence[ParallelConfig],
        seed: int = 0,
        *,
        pricing: Pricing | None = None,
        order: Sequence[ParallelConfig] | None = None,
    ):
        super().__init__(candidates, seed, pricing=pricing)
        self.order = list(order) if order is not None else list(candidates)

    def _propose(self) -> ParallelConfig | None:
        return next((c for c in self.order if c not in self.seen), None)


class RandomSampler(BaseSampler):
    name = "random"

    def _propose(self) -> ParallelConfig | None:
        left = self.remaining()
        return self.rng.choice(left) if left else None
