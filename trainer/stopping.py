"""When a trial stops measuring: its step time is stable, it is too slow to matter, or it ran all
of `measure_steps`.

    stop = measurement_stop(cfg, step_times_s)   # None: measure another step

Every rank calls it after each measured step with the same all-reduced step times (max over
ranks), so every rank reaches the same verdict and none is left waiting in a collective.

Stable: the half-width of the ~95 % confidence interval of the mean step time (Student's t with
n - 1 degrees of freedom: t * s / sqrt(n)) is at most `stable_rel_ci` of the mean. The mean is
what tokens/s is computed from (tokens_per_step * n / sum), so this bounds tokens/s's error the
same way. With 3 steps t = 4.30, so 2 % needs a coefficient of variation under 0.8 %; with 5
steps (t = 2.78) under 1.6 %; noisy steps keep measuring, up to `measure_steps`.
Too slow: after `min_measure_steps`, tokens/s so far below `abandon_below_tokens_per_s` (the
tuner sets it to a fraction of the best measured so far): the trial ends as status "pruned",
its partial measurement kept. Torch-free, like trainer/contract/model.py.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Literal

from trainer.contract.result import BenchmarkConfig

# Two-sided 95 % quantiles of Student's t, t_{0.975, df} for df = 1..30 (any statistics table).
# Above 30 degrees of freedom the df = 30 value is used: a little wider than the true interval.
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
         2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
         2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)  # fmt: skip


@dataclass(frozen=True)
class Stop:
    why: Literal["stable", "pruned", "max_steps"]
    message: str


def rel_ci_half_width(step_times_s: list[float]) -> float:
    """Half-width of the ~95 % confidence interval of the mean step time, relative to the mean
    (inf below 2 steps: no spread to judge from)."""
    n = len(step_times_s)
    if n < 2:
        return math.inf
    mean = statistics.fmean(step_times_s)
    t = T_975[min(n - 1, len(T_975)) - 1]
    return t * statistics.stdev(step_times_s) / math.sqrt(n) / mean


def measurement_stop(cfg: BenchmarkConfig, step_times_s: list[float]) -> Stop | None:
    """Whether to stop after these measured steps, and why; None: measure another."""
    n = len(step_times_s)
    if n >= cfg.min_measure_steps:
        tokens_per_s = cfg.tokens_per_step * n / sum(step_times_s)
        floor = cfg.abandon_below_tokens_per_s
        # A trial that ran all its steps is fully measured, whatever its speed: not pruned.
        if floor is not None and tokens_per_s < floor and n < cfg.measure_steps:
            return Stop("pruned", f"pruned while running: {tokens_per_s:,.0f} tokens/s < floor "
                                  f"{floor:,.0f} tokens/s after {n} measured steps")  # fmt: skip
        ci = rel_ci_half_width(step_times_s)
        if cfg.stable_rel_ci is not None and ci <= cfg.stable_rel_ci:
            return Stop("stable", f"stable after {n} measured steps: 95 % CI of the mean step time "
                                  f"+-{ci:.1%} <= {cfg.stable_rel_ci:.1%}")  # fmt: skip
    if n >= cfg.measure_steps:
        return Stop("max_steps", f"measured all {n} steps (measure_steps)")
    return None
