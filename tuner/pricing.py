"""One pricing path: a study's model, hardware, dtype and constants, bound once.

    pricing = Pricing.for_study(spec, constants)   # the dtype by the rule that builds the trial
    pricing.estimate(config) -> Estimate           # memoised: a layout is priced once
    pricing.rank(configs) -> [(config, Estimate)]  # fastest predicted first

Samplers, `tuner plan`, predictions, calibration, the API's views and the study runner all price
through one of these, so a CPU study's layouts are priced in the dtype its trials run in (fp32),
never in the spec's training precision, and a layout a sampler priced is not priced again.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from trainer.contract.devices import Dtype
from trainer.contract.model import ModelConfig
from trainer.contract.parallel import ParallelConfig
from tuner.cost.terms import Estimate
from tuner.fitting import Measurement
from tuner.perfconstants import ModelConstants, default_constants
from tuner.perfmodel import estimate
from tuner.spec import ClusterSpec, StudySpec

Ranked = list[tuple[ParallelConfig, Estimate]]


@dataclass(frozen=True)
class Pricing:
    model: ModelConfig  # as the spec gives it; each layout pads its vocabulary (tuner.spec.padded_model)
    hardware: ClusterSpec
    dtype: Dtype  # what the trainer computes in: StudySpec.trial_dtype
    constants: ModelConstants
    # A mixture of experts' max/mean tokens per expert the study prices (StudySpec.moe_imbalance:
    # 1 under forced-balance routing); no effect on a dense model.
    moe_imbalance: float = 1.0
    # The gradients' reduce and accumulation dtype (TrainingSpec.grad_reduce_dtype): fp32 or bf16.
    grad_reduce_dtype: str = "fp32"
    _memo: dict[ParallelConfig, Estimate] = field(
        default_factory=dict, init=False, repr=False, compare=False, hash=False
    )

    @classmethod
    def for_study(cls, spec: StudySpec, constants: ModelConstants | None = None) -> Pricing:
        """The study's pricing: its model at its sequence length, its cluster, the dtype its trials
        run in (the rule tuner.spec.benchmark_config uses), and `constants` (default: the
        cluster's device kind's defaults; callers pass the database's calibration)."""
        return cls(
            spec.as_model_config(), spec.cluster, spec.trial_dtype, constants or default_constants(spec.cluster),
            spec.moe_imbalance, spec.training.grad_reduce_dtype,
        )  # fmt: skip

    def with_constants(self, constants: ModelConstants) -> Pricing:
        return Pricing(
            self.model, self.hardware, self.dtype, constants, self.moe_imbalance, self.grad_reduce_dtype
        )

    def estimate(self, config: ParallelConfig) -> Estimate:
        est = self._memo.get(config)
        if est is None:
            est = self._memo[config] = estimate(
                self.model, config, self.hardware, self.dtype, self.constants, self.moe_imbalance,
                self.grad_reduce_dtype,
            )  # fmt: skip
        return est

    def rank(self, configs: Iterable[ParallelConfig]) -> Ranked:
        """Every layout with its estimate, the most predicted tokens/s first (equal predictions
        keep their given order), whether it fits or not."""
        scored = [(c, self.estimate(c)) for c in configs]
        scored.sort(key=lambda ce: -ce[1].tokens_per_s)
        return scored

    def fastest_fitting(self, configs: Iterable[ParallelConfig]) -> tuple[ParallelConfig, Estimate] | None:
        """The layout predicted fastest among those predicted to fit; None if none fits."""
        return next(((c, e) for c, e in self.rank(configs) if e.fits), None)

    def measurement(self, config: ParallelConfig, step_time_s: float) -> Measurement:
        """A measured step time of `config` as calibrate() takes it (priced the same way)."""
        return Measurement(
            self.model,
            config,
            self.hardware,
            step_time_s,
            self.dtype,
            self.moe_imbalance,
            self.grad_reduce_dtype,
        )
