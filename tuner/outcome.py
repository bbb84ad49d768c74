"""Trial states and outcomes: what happened to a layout, in the tuner's words."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from trainer.config import BenchmarkResult


class TrialState(str, enum.Enum):
    WAITING = "WAITING"
    RUNNING = "RUNNING"
    COMPLETE = "COMPLETE"
    PRUNED = "PRUNED"  # never run: predicted not to fit (the reason is stored)
    FAIL = "FAIL"

    def is_finished(self) -> bool:
        return self in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)


class FailureKind(str, enum.Enum):
    """Whose fault: the layout's (told to the sampler as infeasible) or the infrastructure's
    (retried, never told)."""

    OOM = "oom"
    INVALID = "invalid"
    CRASH = "crash"
    TIMEOUT = "timeout"
    INFRA = "infra"  # node failure, preemption, lost worker: not the layout's fault
    CANCELLED = "cancelled"  # the study was cancelled while the trial ran

    @property
    def layout_fault(self) -> bool:
        return self not in (FailureKind.INFRA, FailureKind.CANCELLED)


@dataclass(frozen=True)
class Outcome:
    """A finished trial: ok with metrics, or a failure with its kind and message."""

    ok: bool
    tokens_per_s: float = 0.0
    tflops_per_device: float = 0.0
    mfu: float = 0.0
    peak_memory_bytes: int = 0
    step_time_s: float = 0.0
    failure: FailureKind | None = None
    message: str = ""
    result: dict[str, Any] = field(default_factory=dict)  # the BenchmarkResult, as stored

    @property
    def infeasible(self) -> bool:
        """The layout cannot run here (OOM, invalid): a constraint for samplers, not a score."""
        return self.failure in (FailureKind.OOM, FailureKind.INVALID)

    @classmethod
    def failed(cls, kind: FailureKind, message: str, result: dict | None = None) -> Outcome:
        return cls(ok=False, failure=kind, message=message, result=result or {})


def classify(result: BenchmarkResult) -> Outcome:
    """A trainer result -> Outcome. Timeouts are reported by the launcher as errors that say so."""
    data = result.to_dict()
    if result.ok:
        times = sorted(result.step_times_s)
        return Outcome(
            ok=True, tokens_per_s=result.tokens_per_s, tflops_per_device=result.model_tflops_per_device,
            mfu=result.mfu, peak_memory_bytes=result.peak_memory_bytes,
            step_time_s=times[len(times) // 2] if times else 0.0, result=data,
        )  # fmt: skip
    if result.status == "oom":
        return Outcome.failed(FailureKind.OOM, result.error, data)
    if result.status == "invalid":
        return Outcome.failed(FailureKind.INVALID, result.error, data)
    if result.error.startswith("timed out"):
        return Outcome.failed(FailureKind.TIMEOUT, result.error, data)
    return Outcome.failed(FailureKind.CRASH, result.error, data)
