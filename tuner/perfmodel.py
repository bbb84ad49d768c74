"""An analytic model of one training step: memory per device and step time, for any layout, with
every second of the step in a named term (tuner/cost/terms.py `StepTerms`: they add up to
`step_time_s`).

Callers price through tuner.pricing.Pricing (one per study: model, hardware, dtype, constants);
`estimate()` is the formula it calls. The model itself is the package tuner/cost/, by parts: one
`Case` (case.py) and each axis's part of the step and of the memory (compute.py, tensor.py,
pipeline.py, data.py, context.py, experts.py; the assembly in step.py and memory.py). This module
keeps the entry point.
"""

from __future__ import annotations

from trainer.contract.model import ModelConfig
from trainer.contract.parallel import ParallelConfig
from tuner.cost.case import Case
from tuner.cost.step import estimate_case
from tuner.cost.terms import Estimate
from tuner.perfconstants import ModelConstants
from tuner.spec import ClusterSpec

__all__ = ["estimate"]


def estimate(
    m: ModelConfig,
    p: ParallelConfig,
    cluster: ClusterSpec,
    precision: str = "bf16",
    constants: ModelConstants | None = None,
    moe_imbalance: float = 1.0,
    grad_reduce_dtype: str = "fp32",
) -> Estimate:
    """Memory and step time of layout `p` of model `m` on `cluster`, computing in `precision`
    (the dtype trials run in: tuner.pricing.Pricing passes StudySpec.trial_dtype). `moe_imbalance`:
    a mixture of experts' max/mean tokens per expert (StudySpec.moe_imbalance; 1: balanced);
    `grad_reduce_dtype`: the gradients' (TrainingSpec.grad_reduce_dtype)."""
    return estimate_case(Case.priced(m, p, cluster, precision, constants, moe_imbalance, grad_reduce_dtype))
