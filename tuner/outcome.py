"""States and outcomes in the tuner's words, and the one failure policy.

- `StudyStatus` and its allowed transitions (`STUDY_TRANSITIONS`): `tuner.store.transition` is
  the only writer of a study's status and refuses any other move.
- `TrialState`: WAITING -> SUBMITTING -> RUNNING -> COMPLETE | PRUNED | FAIL. PRUNED: never run
  (predicted not to fit: failure kind predicted_oom), or stopped while running, too slow next to
  the best so far: a measurement of fewer steps, not a failure (its reason in `stop_reason`).
- The public vocabulary (`.word`, `parse()`): one lower-case word per state, the same for studies
  and trials in the API, the CLI, the dashboard and /metrics (docs/api.md, "Vocabulary"); older
  words are accepted on input. This module is the only place a state is spelled out.
- `Outcome`: how one attempt of a trial ended; `classify()` turns the trainer's typed result
  into one.
- The policy (docs/samplers.md, "Failures"): `retry()` says whether an attempt that failed runs
  again as the same trial, `feedback()` what a sampler is told about a trial that ended. Every
  sampler and the runner use these two functions and nothing else.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from trainer.contract.result import BenchmarkResult


class StudyStatus(enum.StrEnum):
    PENDING = "PENDING"  # waiting for a worker (new, handed back, or paused until resume_after)
    RUNNING = "RUNNING"  # held by a worker's lease
    CANCELLING = "CANCELLING"  # cancel asked: the lease holder stops its trials, then CANCELLED
    COMPLETE = "COMPLETE"
    FAILED = "FAILED"  # the study itself cannot run (no valid layout, a broken spec): never a trial's fault
    CANCELLED = "CANCELLED"

    @property
    def is_final(self) -> bool:
        return self in FINAL_STUDY

    @property
    def word(self) -> str:
        """The public word (API, CLI, dashboard, metrics)."""
        return words(type(self))[self]

    @classmethod
    def parse(cls, text: str) -> StudyStatus:
        """A study status from its word, an older word or its stored value (any case)."""
        return _parse(cls, text)


FINAL_STUDY = frozenset({StudyStatus.COMPLETE, StudyStatus.FAILED, StudyStatus.CANCELLED})
# What each status may become. RUNNING -> RUNNING is a take-over of an expired lease.
STUDY_TRANSITIONS: dict[StudyStatus, frozenset[StudyStatus]] = {
    StudyStatus.PENDING: frozenset({StudyStatus.RUNNING, StudyStatus.CANCELLING, StudyStatus.CANCELLED}),
    StudyStatus.RUNNING: frozenset(
        {
            StudyStatus.RUNNING,
            StudyStatus.PENDING,
            StudyStatus.CANCELLING,
            StudyStatus.COMPLETE,
            StudyStatus.FAILED,
        }
    ),
    StudyStatus.CANCELLING: frozenset({StudyStatus.CANCELLING, StudyStatus.CANCELLED}),
    StudyStatus.COMPLETE: frozenset(),
    StudyStatus.FAILED: frozenset(),
    StudyStatus.CANCELLED: frozenset(),
}


def allowed_from(to: StudyStatus) -> frozenset[StudyStatus]:
    """The statuses a study may be in for a move to `to`."""
    return frozenset(s for s, targets in STUDY_TRANSITIONS.items() if to in targets)


class TrialState(enum.StrEnum):
    WAITING = "WAITING"  # new, or re-queued after a retryable failure
    SUBMITTING = "SUBMITTING"  # handed to the dispatcher; its job id not stored yet
    RUNNING = "RUNNING"
    COMPLETE = "COMPLETE"
    PRUNED = "PRUNED"  # never run (predicted not to fit) or pruned while running; the reason is stored
    FAIL = "FAIL"

    def is_finished(self) -> bool:
        return self in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)

    @property
    def word(self) -> str:
        """The public word (API, CLI, dashboard, metrics)."""
        return words(type(self))[self]

    @classmethod
    def parse(cls, text: str) -> TrialState:
        """A trial state from its word, an older word or its stored value (any case)."""
        return _parse(cls, text)


ACTIVE_TRIAL = (TrialState.SUBMITTING, TrialState.RUNNING)

# --- the public vocabulary -------------------------------------------------------------------------
# One lower-case word per state, studies and trials alike. Until this vocabulary, studies spoke
# lower-case words (a complete study was "done") and trials their upper-case stored values
# ("COMPLETE", "FAIL"): those older words are still accepted on input (query filters, the CLI
# reading an older server), as is any case.
# Separate tables: a StrEnum member equals its value, so StudyStatus.RUNNING and TrialState.RUNNING
# are the same dict key.
STUDY_WORDS: dict[StudyStatus, str] = {
    StudyStatus.PENDING: "pending", StudyStatus.RUNNING: "running", StudyStatus.CANCELLING: "cancelling",
    StudyStatus.COMPLETE: "complete", StudyStatus.FAILED: "failed", StudyStatus.CANCELLED: "cancelled",
}  # fmt: skip
TRIAL_WORDS: dict[TrialState, str] = {
    TrialState.WAITING: "waiting", TrialState.SUBMITTING: "submitting", TrialState.RUNNING: "running",
    TrialState.COMPLETE: "complete", TrialState.PRUNED: "pruned", TrialState.FAIL: "failed",
}  # fmt: skip
OLDER_STUDY_WORDS = {"done": StudyStatus.COMPLETE}  # besides every stored value, in any case


def words(cls: type[StudyStatus] | type[TrialState]) -> dict:
    """{member: its word} of the enum `cls`, in the enum's order."""
    return STUDY_WORDS if cls is StudyStatus else TRIAL_WORDS


@functools.cache  # parsed for every state in every response model the CLI reads back
def accepted_words(cls: type[StudyStatus] | type[TrialState]) -> dict[str, StudyStatus | TrialState]:
    """Every lower-case word `parse` takes: the words, the older words and the stored values."""
    older = OLDER_STUDY_WORDS if cls is StudyStatus else {}
    return {m.value.lower(): m for m in cls} | older | {w: m for m, w in words(cls).items()}


def _parse(cls, text: str):
    found = accepted_words(cls).get(str(text).strip().lower())
    if found is None:
        current = list(words(cls).values())
        older = sorted(set(accepted_words(cls)) - set(current))
        raise ValueError(
            f"{text!r} is not one of {', '.join(current)} (older words accepted: {', '.join(older)})"
        )
    return found


class FailureKind(enum.StrEnum):
    """Why an attempt failed. Whose fault it is, and what follows, is `retry()` and `feedback()`."""

    OOM = "oom"  # measured: the layout needs more memory than the device has
    PREDICTED_OOM = "predicted_oom"  # never run: the performance model says it cannot fit
    INVALID = "invalid"  # the trainer refused the layout for this model
    CRASH = "crash"  # the trainer or a rank died
    TIMEOUT = "timeout"  # hung or too slow: whichever timer fired (launcher, Slurm, a collective)
    INFRA = "infra"  # node failure, preemption, a lost worker or allocation: not the layout's fault
    CANCELLED = "cancelled"  # the study was cancelled, or someone cancelled the job


# The kind of an attempt the trainer stopped early as too slow (BenchmarkResult status 'pruned'), in
# attempt logs: not a failure, its partial measurement is a true one (the trial ends PRUNED with
# its `stop_reason`, no failure kind).
PRUNED_RUNNING = "pruned_running"


@dataclass(frozen=True)
class Outcome:
    """How one attempt ended: ok with metrics (`pruned`: partial ones, stopped early as too slow;
    the reason in `message`), or a failure with its kind and message."""

    ok: bool
    tokens_per_s: float = 0.0
    tflops_per_device: float = 0.0
    mfu: float = 0.0
    peak_memory_bytes: int = 0
    step_time_s: float = 0.0
    failure: FailureKind | None = None
    message: str = ""
    pruned: bool = False
    result: dict[str, Any] = field(default_factory=dict)  # the BenchmarkResult, as stored

    @classmethod
    def failed(cls, kind: FailureKind, message: str, result: dict | None = None) -> Outcome:
        return cls(ok=False, failure=kind, message=message, result=result or {})

    @property
    def kind(self) -> str:
        """'ok', 'pruned_running' or the failure kind's value (what attempt logs and the API show)."""
        if self.ok:
            return PRUNED_RUNNING if self.pruned else "ok"
        return (self.failure or FailureKind.CRASH).value


# The trainer's typed statuses (trainer/contract/result.py: BenchmarkResult.status) -> failure kinds.
_STATUS_KINDS = {"oom": FailureKind.OOM, "invalid": FailureKind.INVALID, "timeout": FailureKind.TIMEOUT,
                 "error": FailureKind.CRASH}  # fmt: skip


def classify(result: BenchmarkResult) -> Outcome:
    """A trainer result -> Outcome, by its typed status only."""
    data = result.to_dict()
    if result.measured:
        times = sorted(result.step_times_s)
        pruned = result.status == "pruned"
        return Outcome(
            ok=True, tokens_per_s=result.tokens_per_s, tflops_per_device=result.model_tflops_per_device,
            mfu=result.mfu, peak_memory_bytes=result.peak_memory_bytes,
            step_time_s=times[len(times) // 2] if times else 0.0, result=data, pruned=pruned,
            message=result.stopped_because if pruned else "",
        )  # fmt: skip
    return Outcome.failed(_STATUS_KINDS.get(result.status, FailureKind.CRASH), result.error, data)


# --- the failure policy ---------------------------------------------------------------------------


class Feedback(enum.StrEnum):
    """What a sampler hears about a finished trial."""

    SCORE = "score"  # tokens/s
    INFEASIBLE = "infeasible"  # a constraint: never propose this layout, learn from it
    NOTHING = "nothing"  # not the layout's fault: the sampler does not hear of it


# Kinds that say the layout cannot run well here. A crash is told only once it repeated (see
# retry()): one crash may be a flaky node or a rank killed from outside.
_INFEASIBLE = frozenset({FailureKind.OOM, FailureKind.PREDICTED_OOM, FailureKind.INVALID,
                         FailureKind.CRASH, FailureKind.TIMEOUT})  # fmt: skip


def feedback(outcome: Outcome) -> Feedback:
    """What a sampler is told about a trial that ended with `outcome` (its last attempt):
    ok -> its score, pruned while running too (a true measurement, of fewer steps); OOM (measured
    or predicted), invalid, a timeout (hung or too slow within the trial's limit) and a crash that
    repeated -> infeasible; infrastructure failures and cancellations (the study's, or an
    administrator's scancel) -> nothing."""
    if outcome.ok:
        return Feedback.SCORE
    return Feedback.INFEASIBLE if outcome.failure in _INFEASIBLE else Feedback.NOTHING


def retry(outcome: Outcome, previous: Sequence[str], *, max_retries: int, crash_retries: int) -> bool:
    """Whether a failed attempt runs again as the same trial (re-queued, not told). `previous` are
    the kinds of the trial's earlier attempts (Outcome.kind). Infrastructure failures are retried
    up to `max_retries` times, a crash up to `crash_retries` times (a crash that repeats is the
    layout's); nothing else is retried (a trial pruned while running is ok: not retried)."""
    if outcome.ok:
        return False
    if outcome.failure is FailureKind.INFRA:
        return sum(k == FailureKind.INFRA.value for k in previous) < max_retries
    if outcome.failure is FailureKind.CRASH:
        return sum(k == FailureKind.CRASH.value for k in previous) < crash_retries
    return False
