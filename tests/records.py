"""Trials and studies written through the store's own transitions, as a runner writes them, for
tests that need results in a database without running trials (API, dashboard, store)."""

from __future__ import annotations

from pathlib import Path

from trainer.contract.parallel import ParallelConfig
from tuner import store
from tuner.dispatch import JobHandle
from tuner.outcome import Outcome, StudyStatus, TrialState, feedback

OWNER = store.Owner("test-worker@host:1:abcdef", "host", 1)


def record_trial(s, study, config: ParallelConfig, outcome: Outcome | None, predicted: dict | None = None,
                 job: str | None = None) -> store.Trial:  # fmt: skip
    """A trial that ran and ended with `outcome` (None: still running)."""
    trial = store.add_trial(s, study, config, predicted, TrialState.WAITING)
    assert store.begin_attempt(s, trial)
    handle = job or str(JobHandle("fake", str(trial.number + 1), Path(f"/tmp/trial-{trial.number}")))
    assert store.attach_job(s, trial, handle, f"/tmp/trial-{trial.number}/log.txt")
    if outcome is not None:
        assert store.end_attempt(s, trial, outcome, requeue=False, told=feedback(outcome))
    return trial


def hold(s, study_id: int) -> None:
    """The study RUNNING under the test worker's lease."""
    store.claim(s, study_id, OWNER)


def finish(s, study_id: int, status: StudyStatus = StudyStatus.COMPLETE) -> None:
    """The study ended by its (test) worker."""
    if store.status_of(s.get(store.Study, study_id)) is StudyStatus.PENDING:
        hold(s, study_id)
    if status is StudyStatus.CANCELLED:
        store.cancel(s, study_id, "cancelled by the test")
        status = StudyStatus.CANCELLED
    assert store.finish(s, study_id, OWNER, status)
