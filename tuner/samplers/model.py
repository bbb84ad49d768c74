"""`model`: our sampler. Rank the valid space by the calibrated performance model, run the
best-predicted layout, recalibrate from every measurement, explore where the model is unsure."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from trainer.contract.parallel import ParallelConfig
from tuner.cost.experts import measured_imbalance
from tuner.fitting import Measurement, calibrate
from tuner.outcome import FailureKind, Feedback, Outcome
from tuner.pricing import Pricing
from tuner.samplers.base import BaseSampler

PRIOR_SIGMA = 0.3  # log-space spread of an uncalibrated prediction (~35 %), until surprises say
PRIOR_POINTS = 2.0  # what PRIOR_SIGMA weighs against the surprises measured so far
MAX_CALIBRATION_POINTS = 40  # the fastest layouts measured: the ones that decide the ranking


class ModelSampler(BaseSampler):
    """Upper confidence bound on log tokens/s: log(predicted) + beta * sigma * novelty, novelty 1
    for a (tp, pp, dp) family not measured yet. sigma is how wrong the model has been on this
    study: each measurement's surprise, log(measured / predicted) by the model as it stood before
    that trial, pooled with PRIOR_SIGMA worth PRIOR_POINTS trials. So the exploration bonus starts
    at PRIOR_SIGMA and shrinks as the calibrated model stops being surprised (and grows while it
    keeps being wrong). A layout that ran out of memory puts a wall at its predicted memory:
    layouts predicted to need as much or more are not proposed while others remain. Its estimates
    (BaseSampler.estimate) are the current calibration's: what each proposal was chosen by. A
    mixture of experts with learned routing prices each trial at the imbalance it measured and
    the rest at their mean (tuner.cost.experts.measured_imbalance), not the study's prior."""

    name = "model"

    def __init__(
        self, candidates: Sequence[ParallelConfig], seed: int = 0, *, pricing: Pricing, beta: float = 1.0
    ):
        super().__init__(candidates, seed, pricing=pricing)
        self.beta = beta
        self.initial = pricing  # every recalibration starts from the study's constants
        self.measured: list[Measurement] = []
        self.surprises: list[float] = []  # log(measured / predicted before the trial), per trial
        self.imbalances: list[float] = []  # a mixture of experts' I measured by each trial (learned routing)
        self.sigma = PRIOR_SIGMA
        self.memory_wall = math.inf
        self.families: set[tuple[int, int, int, int]] = set()  # (tp, pp, dp, ep) measured
        self._predict()

    def _predict(self) -> None:
        ests = [(c, self.pricing.estimate(c)) for c in self.candidates]
        self.log_tps = {c: math.log(max(e.tokens_per_s, 1e-12)) for c, e in ests}
        self.memory = {c: e.memory_bytes for c, e in ests}

    def _propose(self) -> ParallelConfig | None:
        left = self.remaining()
        below = [c for c in left if self.memory[c] < self.memory_wall]
        pool = below or left
        if not pool:
            return None

        def score(c: ParallelConfig) -> float:
            novelty = 0.0 if (c.tp, c.pp, c.dp, c.ep) in self.families else 1.0
            return self.log_tps[c] + self.beta * self.sigma * novelty

        return max(pool, key=score)  # ties: the earlier candidate (max keeps the first)

    def _observe(self, config: ParallelConfig, outcome: Outcome, told: Feedback) -> None:
        if told is Feedback.INFEASIBLE and outcome.failure is FailureKind.OOM:  # measured, not predicted
            self.memory_wall = min(self.memory_wall, self.memory[config])
            return
        if told is not Feedback.SCORE or outcome.step_time_s <= 0:
            return
        self.families.add((config.tp, config.pp, config.dp, config.ep))
        self.surprises.append(math.log(max(outcome.tokens_per_s, 1e-12)) - self.log_tps[config])
        self.sigma = math.sqrt(
            (PRIOR_POINTS * PRIOR_SIGMA**2 + sum(r * r for r in self.surprises))
            / (PRIOR_POINTS + len(self.surprises))
        )
        # A mixture of experts with learned routing: the trial's own I prices its measurement, and
        # the mean of the I measured so far replaces the study's prior (training.moe_imbalance).
        imbalance = measured_imbalance(outcome.result)
        priced = self.pricing
        if imbalance is not None:
            priced = dataclasses.replace(self.pricing, moe_imbalance=imbalance)
            self.imbalances.append(imbalance)
            self.initial = dataclasses.replace(
                self.initial, moe_imbalance=sum(self.imbalances) / len(self.imbalances)
            )
        self.measured.append(priced.measurement(config, outcome.step_time_s))
        n = len(self.measured)
        if (
            n > 30 and n % 10 and imbalance is None
        ):  # past 30 points recalibrate every 10th: each fit costs ~n estimates
            return
        points = sorted(self.measured, key=lambda m: m.step_time_s)[:MAX_CALIBRATION_POINTS]
        self.pricing = self.initial.with_constants(calibrate(points, self.initial.constants))
        self._predict()
