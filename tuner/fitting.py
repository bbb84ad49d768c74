"""Fitting the performance model to measurements: calibrate() fits the step-time constants,
fit_memory_scale() the memory scale, rms_log_error() says how well a set of constants fits.
tuner/calibration.py runs them on a finished study; the benchmarks on recorded tables."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from trainer.contract.model import ModelConfig
from trainer.contract.parallel import ParallelConfig
from tuner.memmodel import memory
from tuner.perfconstants import FITTED, ModelConstants, default_constants
from tuner.perfmodel import estimate
from tuner.spec import ClusterSpec


@dataclass(frozen=True)
class Measurement:
    """One measured step time of a layout, the input to calibrate()."""

    model: ModelConfig
    parallel: ParallelConfig
    cluster: ClusterSpec
    step_time_s: float
    precision: str = "bf16"
    moe_imbalance: float = 1.0  # the study's (StudySpec.moe_imbalance): priced as the study prices it
    grad_reduce_dtype: str = "fp32"  # the study's (TrainingSpec.grad_reduce_dtype)


# Each fitted constant in an unbounded coordinate: log for scales, logit for fractions.
_FRACTIONS = {"compute_efficiency", "comm_efficiency"}


def _to_free(c: ModelConstants, names: tuple[str, ...]) -> list[float]:
    return [math.log(v / (1 - v)) if k in _FRACTIONS else math.log(v) for k in names for v in [getattr(c, k)]]


def _from_free(x, base: ModelConstants, names: tuple[str, ...]) -> ModelConstants:
    values = {}
    for k, z in zip(names, x, strict=True):
        z = max(min(float(z), 40.0), -40.0)
        values[k] = 1 / (1 + math.exp(-z)) if k in _FRACTIONS else math.exp(z)
    return dataclasses.replace(base, **values)


def calibrate(
    measurements: list[Measurement],
    initial: ModelConstants | None = None,
    prior_weight: float = 0.2,
    fitted: tuple[str, ...] = FITTED,
) -> ModelConstants:
    """Least squares on log step time over the `fitted` constants, with a pull towards `initial`
    (default: the cluster kind's defaults) worth `prior_weight` measurements in all: a handful of
    measurements cannot send the constants they do not observe anywhere, and many outweigh it."""
    from scipy.optimize import least_squares

    if not measurements:
        return initial or ModelConstants()
    base = initial or default_constants(measurements[0].cluster)
    x0 = _to_free(base, fitted)

    def residuals(x):
        c = _from_free(x, base, fitted)
        res = [
            math.log(
                estimate(
                    r.model, r.parallel, r.cluster, r.precision, c, r.moe_imbalance, r.grad_reduce_dtype
                ).step_time_s
                / r.step_time_s
            )
            for r in measurements
        ]
        pull = math.sqrt(prior_weight / len(measurements))
        return res + [pull * (xi - x0i) for xi, x0i in zip(x, x0, strict=True)]

    fit = least_squares(residuals, x0, method="lm" if len(measurements) >= 4 else "trf")
    return _from_free(fit.x, base, fitted)


def fit_memory_scale(measured: list[tuple[Measurement, float]], constants: ModelConstants) -> ModelConstants:
    """`constants` with memory_scale = the median over (layout, measured peak bytes) of measured over
    predicted tensor bytes (the workspace left out of both); unchanged without measurements."""
    ratios = []
    for m, peak in measured:
        unscaled = dataclasses.replace(constants, memory_scale=1.0)
        tensors = (
            memory(
                m.model,
                m.parallel,
                m.precision,
                unscaled,
                moe_imbalance=m.moe_imbalance,
                grad_reduce_dtype=m.grad_reduce_dtype,
            )["memory_bytes"]
            - constants.workspace_bytes
        )
        if peak > constants.workspace_bytes and tensors > 0:
            ratios.append((peak - constants.workspace_bytes) / tensors)
    if not ratios:
        return constants
    ratios.sort()
    mid = len(ratios) // 2
    median = ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2
    return dataclasses.replace(constants, memory_scale=min(max(median, 0.5), 4.0))


def rms_log_error(measurements: list[Measurement], constants: ModelConstants) -> float:
    """Root mean square of log(predicted / measured) step time: 0.1 is ~10 % typical error."""
    if not measurements:
        return 0.0
    res = [
        math.log(
            estimate(
                r.model, r.parallel, r.cluster, r.precision, constants, r.moe_imbalance, r.grad_reduce_dtype
            ).step_time_s
            / r.step_time_s
        )
        for r in measurements
    ]
    return math.sqrt(sum(x * x for x in res) / len(res))
