"""What tuning cost, and what it bought: for a study, the device-hours its trials used, the speed-up
of its best layout over two baselines measured in the same study, and when that pays back.

Baselines, both measured at the best layout's device count (throughputs at different device
counts are not comparable):
- `first_guess`: the layout the performance model ranked first when the study started (the
  trial with the highest predicted tokens/s at proposal time, the earliest of equal ones; every
  sampler but `random` runs it first). What a user would have run without tuning, if they trusted the model.
- `median`: the median measured layout: what picking a layout by hand gets you on average.

Pay-back: training on the best layout instead of a baseline saves devices x (speed-up - 1)
device-seconds per second of training, so the tuning's device-seconds are recovered after
tuning / (devices x (speed-up - 1)) seconds of training. With `training.total_tokens` in the spec,
the whole run's saving in device-hours too.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import BaseModel


@dataclass(frozen=True)
class Measured:
    """One completed trial, as the payoff needs it."""

    world_size: int
    tokens_per_s: float
    predicted_tokens_per_s: float | None


class Baseline(BaseModel):
    name: str  # "first_guess" | "median"
    tokens_per_s: float
    speedup: float  # best / baseline
    payback_minutes: float | None  # training minutes (on the best layout) that repay the tuning
    saved_device_hours: float | None  # over training.total_tokens, when the spec gives it


class Payoff(BaseModel):
    tuning_device_hours: float
    best_tokens_per_s: float | None = None
    devices: int | None = None  # the best layout's device count
    baselines: list[Baseline] = []


def payoff(tuning_device_s: float, measured: Sequence[Measured], total_tokens: int | None = None) -> Payoff:
    out = Payoff(tuning_device_hours=tuning_device_s / 3600)
    if not measured:
        return out
    best = max(measured, key=lambda m: m.tokens_per_s)
    peers = [m for m in measured if m.world_size == best.world_size]
    out.best_tokens_per_s, out.devices = best.tokens_per_s, best.world_size
    guesses = [m for m in peers if m.predicted_tokens_per_s is not None]
    named = []
    if guesses:
        named.append(("first_guess", max(guesses, key=lambda m: m.predicted_tokens_per_s).tokens_per_s))
    named.append(("median", statistics.median(m.tokens_per_s for m in peers)))
    for name, base in named:
        speedup = best.tokens_per_s / base
        gain_per_s = best.world_size * (speedup - 1)  # device-seconds saved per second of training
        payback = tuning_device_s / gain_per_s / 60 if gain_per_s > 0 else None
        saved = None
        if total_tokens:
            saved = best.world_size * (total_tokens / base - total_tokens / best.tokens_per_s) / 3600
        out.baselines.append(Baseline(name=name, tokens_per_s=base, speedup=speedup, payback_minutes=payback,
                                      saved_device_hours=saved))  # fmt: skip
    return out


def describe(p: Payoff) -> str:
    """One line for the CLI: 'tuning 0.12 device-h; 1.8x the first guess (pays back in 4 min), ...'."""
    parts = [f"tuning {p.tuning_device_hours:.3g} device-h"]
    for b in p.baselines:
        label = "the model's first guess" if b.name == "first_guess" else "the median layout"
        back = (
            f"pays back in {b.payback_minutes:.3g} min of training"
            if b.payback_minutes is not None
            else "no gain"
        )
        saved = f", saves {b.saved_device_hours:,.4g} device-h over the run" if b.saved_device_hours else ""
        parts.append(f"{b.speedup:.2f}x {label} ({back}{saved})")
    return "; ".join(parts)
