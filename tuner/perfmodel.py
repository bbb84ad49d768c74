"""An analytic model of one training step: memory per device and step time, for any layout, with
every second of the step in a named term (`StepTerms`: they add up to `step_time_s`).

Callers price through tuner.pricing.Pricing (one per study: model, hardware, dtype, constants);
`estimate()` is the formula it calls. The model itself is the package tuner/cost/, by parts: one
`Case` (case.py) and each axis's part of the step and of the memory (compute.py, tensor.py,
pipeline.py, data.py, context.py, experts.py; the assembly in step.py and memory.py). This module
keeps the entry point and the names callers import.
"""

from __future__ import annotations

from trainer.contract.model import ModelConfig
from trainer.contract.parallel import ParallelConfig
from tuner.cost.case import Case
from tuner.cost.compute import (
    Compute,
    attention_fwd_flops_per_token,
    compute,
    elementwise_flops,
    elementwise_units,
    gemm_fwd_flops_per_token,
)
from tuner.cost.experts import moe_info
from tuner.cost.step import estimate_case
from tuner.cost.terms import TERM_LABELS, Estimate, StepTerms
from tuner.perfconstants import ModelConstants
from tuner.spec import ClusterSpec

__all__ = ["TERM_LABELS", "Estimate", "StepTerms", "estimate", "moe_info"]


def estimate(
    m: ModelConfig,
    p: ParallelConfig,
    cluster: ClusterSpec,
    precision: str = "bf16",
    constants: ModelConstants | None = None,
    moe_imbalance: float = 1.0,
) -> Estimate:
    """Memory and step time of layout `p` of model `m` on `cluster`, computing in `precision`
    (the dtype trials run in: tuner.pricing.Pricing passes StudySpec.trial_dtype). `moe_imbalance`:
    a mixture of experts' max/mean tokens per expert (StudySpec.moe_imbalance; 1: balanced)."""
    return estimate_case(Case.priced(m, p, cluster, precision, constants, moe_imbalance))


# The names tests/tuner/test_perfmodel.py reads, with their old signatures, until it prices a Case.
_gemm_fwd_flops_per_token = gemm_fwd_flops_per_token
_attention_fwd_flops_per_token = attention_fwd_flops_per_token
_elementwise_units = elementwise_units


def _elementwise_flops(m: ModelConfig, p: ParallelConfig, precision: str, c: ModelConstants) -> float:
    return elementwise_flops(Case(m, p, precision, c))


def _compute(
    m: ModelConfig, p: ParallelConfig, precision: str, c: ModelConstants, peak_flops: float, memory_peak_flops: float,
    hardware: ClusterSpec | None = None, imbalance: float = 1.0,
) -> Compute:  # fmt: skip
    case = Case(m, p, precision, c, hardware, moe_imbalance=imbalance, peak_flops=peak_flops,
                memory_peak_flops=memory_peak_flops)  # fmt: skip
    return compute(case)
