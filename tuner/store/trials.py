"""Trials: creation, their state changes, and what a study has used of its budget.

Each state change is a compare-and-set UPDATE (`WHERE id = ? AND state = ? AND job_id IS ?`)
that says whether it took, so a runner that lost its lease and the one that took over can never
both end the same attempt. Every ended attempt is appended to `attempt_log` (job, Slurm state,
kind, times, device-seconds); `device_s` sums them for the device-hours budget.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session, object_session

from trainer.contract.axes import AXES
from trainer.contract.parallel import ParallelConfig
from tuner.db import Study, StudyBest, Trial, aware, utcnow
from tuner.outcome import ACTIVE_TRIAL, FailureKind, Feedback, Outcome, TrialState


def layout_key(config: ParallelConfig) -> str:
    """A layout's identity within a study (all knobs, stable order)."""
    return json.dumps(config.to_dict(), sort_keys=True, separators=(",", ":"))


def config_of(trial: Trial) -> ParallelConfig:
    return ParallelConfig.from_dict(trial.config)


# A trial's device count, in SQL: stored from ParallelConfig.world_size when the trial is added,
# so the store never re-derives which axes multiply the world (it once left cp out).
TRIAL_WORLD = Trial.world_size


def world_size(trial: Trial) -> int:
    return trial.world_size


def axis_columns(config: ParallelConfig) -> dict[str, Any]:
    """A trial's layout columns: one per axis of the table, dp and the device count."""
    return {
        **{a.name: getattr(config, a.name) for a in AXES},
        "dp": config.dp,
        "world_size": config.world_size,
    }


def job_name(study: Study | int, number: int, attempt: int) -> str:
    """A trial attempt's job name: unique in the database and on the cluster, so a job submitted
    just before a crash is found again by name (tuner.dispatch: Dispatcher.find)."""
    study_id = study if isinstance(study, int) else study.id
    return f"pt{study_id}-t{number}-a{attempt}"


def trials(session: Session, study: Study, states: tuple[TrialState, ...] | None = None) -> list[Trial]:
    q = select(Trial).where(Trial.study_id == study.id).order_by(Trial.number)
    if states:
        q = q.where(Trial.state.in_(states))
    return list(session.scalars(q))


def trial_by_id(session: Session, trial_id: int) -> Trial | None:
    return session.get(Trial, trial_id)


def add_trial(
    session: Session,
    study: Study,
    config: ParallelConfig,
    predicted: dict[str, Any] | None,
    state: TrialState,
) -> Trial:
    number = (
        session.scalar(select(func.coalesce(func.max(Trial.number), -1)).where(Trial.study_id == study.id))
        + 1
    )
    trial = Trial(
        study_id=study.id, number=number, state=state, layout_key=layout_key(config),
        config=config.to_dict(), **axis_columns(config), predicted=predicted,
        predicted_tokens_per_s=(predicted or {}).get("tokens_per_s"),
        predicted_memory_bytes=(predicted or {}).get("memory_bytes"),
    )  # fmt: skip
    session.add(trial)
    session.flush()
    return trial


def _cas(session: Session, trial: Trial, expect: tuple[TrialState, ...], **values) -> bool:
    """Change the trial if it is still in one of `expect` with the job id we loaded."""
    job = Trial.job_id.is_(None) if trial.job_id is None else Trial.job_id == trial.job_id
    stmt = (
        update(Trial)
        .where(Trial.id == trial.id, Trial.state.in_(expect), job)
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    took = session.execute(stmt).rowcount == 1
    session.refresh(trial)
    return took


def begin_attempt(session: Session, trial: Trial, *, now: dt.datetime | None = None) -> bool:
    """WAITING -> SUBMITTING, before the dispatcher is called: a crash between a submission and
    the commit of its job id leaves the trial SUBMITTING, and the next runner looks the job up by
    name instead of submitting it again."""
    return _cas(session, trial, (TrialState.WAITING,), state=TrialState.SUBMITTING,
                attempts=trial.attempts + 1, started_at=now or utcnow(), job_state=None)  # fmt: skip


def attach_job(session: Session, trial: Trial, job: str, log_path: str | None) -> bool:
    """SUBMITTING -> RUNNING with the job's handle."""
    return _cas(session, trial, (TrialState.SUBMITTING,), state=TrialState.RUNNING, job_id=job,
                log_path=log_path)  # fmt: skip


def submission_failed(
    session: Session, trial: Trial, message: str, *, now: dt.datetime | None = None
) -> bool:
    """SUBMITTING -> WAITING: the dispatcher could not submit, or no job was found under the
    attempt's name after a crash. Logged; no device time, no retry counted against the layout."""
    entry = _log_entry(trial, "dispatch_error", message, None, now or utcnow())
    return _cas(session, trial, (TrialState.SUBMITTING,), state=TrialState.WAITING,
                attempt_log=[*(trial.attempt_log or []), entry],
                failure_message=f"attempt {trial.attempts}: {message}"[-4000:])  # fmt: skip


def note_job_state(session: Session, trial: Trial, job_state: str) -> None:
    if trial.job_state != job_state:
        _cas(session, trial, ACTIVE_TRIAL, job_state=job_state[:32])


def _log_entry(trial: Trial, kind: str, message: str, job_state: str | None, now: dt.datetime) -> dict:
    started = aware(trial.started_at) or now
    device_s = max(0.0, (now - started).total_seconds()) * world_size(trial) if trial.job_id else 0.0
    return {"attempt": trial.attempts, "job": trial.job_id, "job_state": job_state, "kind": kind,
            "message": message[:300], "started_at": started.isoformat(), "ended_at": now.isoformat(),
            "device_s": round(device_s, 3)}  # fmt: skip


def end_attempt(
    session: Session, trial: Trial, outcome: Outcome, *, requeue: bool, told: Feedback | None = None,
    job_state: str | None = None, now: dt.datetime | None = None,
) -> bool:  # fmt: skip
    """The running attempt ended with `outcome`: log it, then either re-queue the trial (WAITING:
    it runs again as the same trial) or finish it: COMPLETE with metrics, PRUNED with its partial
    metrics and why it stopped (pruned while running: a measurement, not a failure, never a best)
    or FAIL with the kind, recording what the sampler is told. A finished trial never changes
    again."""
    now = now or utcnow()
    entry = _log_entry(trial, outcome.kind, outcome.message, job_state or trial.job_state, now)
    common = {"attempt_log": [*(trial.attempt_log or []), entry], "device_s": trial.device_s + entry["device_s"],
              "job_state": (job_state or trial.job_state or None)}  # fmt: skip
    if requeue:
        return _cas(session, trial, ACTIVE_TRIAL, state=TrialState.WAITING, job_id=None,
                    failure_kind=None if outcome.ok else outcome.failure or FailureKind.CRASH,
                    failure_message=f"attempt {trial.attempts}: {outcome.message}"[-4000:], **common)  # fmt: skip
    values: dict[str, Any] = {
        "finished_at": now,
        "result": outcome.result or None,
        "told": told,
    }
    if outcome.ok:
        times = sorted(outcome.result.get("step_times_s", [])) or [outcome.step_time_s]
        values |= {"state": TrialState.COMPLETE, "tokens_per_s": outcome.tokens_per_s,
                   "tflops_per_device": outcome.tflops_per_device, "mfu": outcome.mfu,
                   "peak_memory_bytes": outcome.peak_memory_bytes, "step_time_median_s": outcome.step_time_s,
                   "step_time_min_s": times[0], "step_time_max_s": times[-1], "failure_kind": None,
                   "failure_message": None}  # fmt: skip
        if outcome.pruned:  # a measurement of fewer steps: why it stopped, and no failure
            values |= {
                "state": TrialState.PRUNED,
                "stop_reason": (outcome.message or "pruned while running")[-4000:],
            }
    else:
        values |= {"state": TrialState.FAIL, "failure_kind": outcome.failure or FailureKind.CRASH,
                   "failure_message": outcome.message[-4000:]}  # fmt: skip
    took = _cas(session, trial, ACTIVE_TRIAL, **values, **common)
    if took and outcome.ok and not outcome.pruned:
        _record_best(trial)
    return took


def prune_trial(session: Session, trial: Trial, reason: str, *, now: dt.datetime | None = None) -> bool:
    """Never run: predicted not to fit. Told to the sampler as infeasible."""
    return _cas(session, trial, (TrialState.WAITING,), state=TrialState.PRUNED,
                failure_kind=FailureKind.PREDICTED_OOM, failure_message=reason,
                finished_at=now or utcnow(), told=Feedback.INFEASIBLE)  # fmt: skip


def cancel_waiting(session: Session, study_id: int, message: str, *, now: dt.datetime | None = None) -> int:
    """Queued trials of a study that stops end FAIL `cancelled` (never run, not told)."""
    stmt = (
        update(Trial)
        .where(Trial.study_id == study_id, Trial.state == TrialState.WAITING)
        .values(
            state=TrialState.FAIL,
            failure_kind=FailureKind.CANCELLED,
            failure_message=message,
            finished_at=now or utcnow(),
            told=Feedback.NOTHING,
        )
        .execution_options(synchronize_session=False)
    )
    n = session.execute(stmt).rowcount
    session.expire_all()
    return n


def _record_best(trial: Trial) -> None:
    """Keep study_bests current: this trial, if it is the study's fastest at its device count."""
    session = object_session(trial)
    world = world_size(trial)
    row = session.get(StudyBest, (trial.study_id, world))
    if row is None:
        session.add(StudyBest(study_id=trial.study_id, world_size=world, trial_id=trial.id,
                              tokens_per_s=trial.tokens_per_s or 0.0))  # fmt: skip
    elif (trial.tokens_per_s or 0.0) > row.tokens_per_s:
        row.trial_id, row.tokens_per_s = trial.id, trial.tokens_per_s
    session.flush()


def outcome_of(trial: Trial) -> Outcome | None:
    """A finished trial's outcome as stored (None while unfinished)."""
    state = TrialState(trial.state)
    pruned = pruned_while_running(trial)
    if state is TrialState.COMPLETE or pruned:
        return Outcome(ok=True, tokens_per_s=trial.tokens_per_s or 0.0, tflops_per_device=trial.tflops_per_device or 0.0,
                       mfu=trial.mfu or 0.0, peak_memory_bytes=trial.peak_memory_bytes or 0,
                       step_time_s=trial.step_time_median_s or 0.0, result=trial.result or {}, pruned=pruned,
                       message=trial.stop_reason if pruned else "")  # fmt: skip
    if state in (TrialState.PRUNED, TrialState.FAIL):
        return Outcome.failed(
            FailureKind(trial.failure_kind or FailureKind.CRASH), trial.failure_message or ""
        )
    return None


def pruned_while_running(trial: Trial) -> bool:
    """Stopped early as too slow: a measurement of fewer steps (PRUNED with its stop reason), as
    against a layout pruned before it ran (PRUNED, failure kind predicted_oom)."""
    return trial.state is TrialState.PRUNED and trial.stop_reason is not None


def previous_kinds(trial: Trial) -> list[str]:
    """The kinds of the trial's ended attempts, oldest first (for outcome.retry)."""
    return [e["kind"] for e in trial.attempt_log or []]


# --- what a study has used (its budgets are derived from these rows at every check) ----------


@dataclass(frozen=True)
class Usage:
    trials: int  # trials that count against max_trials: every one but those pruned before running
    finished: int  # COMPLETE, FAIL or pruned while running
    active: int  # SUBMITTING or RUNNING
    device_s: float  # ended attempts, plus the running ones so far
    wall_s: float  # since the study was first claimed
    since_improvement: int  # trials told to the sampler since one beat the best by the margin


def usage(
    session: Session, study: Study, *, min_improvement: float = 0.0, now: dt.datetime | None = None
) -> Usage:
    now = now or utcnow()
    rows = session.execute(
        select(Trial.state, TRIAL_WORLD, Trial.started_at, Trial.device_s, Trial.told,
               Trial.tokens_per_s, Trial.stop_reason)
        .where(Trial.study_id == study.id).order_by(Trial.finished_at, Trial.id)
    ).all()  # fmt: skip
    counted = finished = active = 0
    device_s, best, since = 0.0, 0.0, 0
    for state, world, started, spent, told, tokens, stopped in rows:
        device_s += spent or 0.0
        if state is TrialState.PRUNED and stopped is None:  # never ran
            continue
        counted += 1
        if state in ACTIVE_TRIAL:
            active += 1
            if started is not None:
                device_s += max(0.0, (now - aware(started)).total_seconds()) * world
        elif state.is_finished():
            finished += 1
            if told in (Feedback.SCORE, Feedback.INFEASIBLE):
                if tokens and tokens > best * (1 + min_improvement):
                    since = 0
                else:
                    since += 1
                best = max(best, tokens or 0.0)
    started_at = aware(study.started_at)
    wall_s = (now - started_at).total_seconds() if started_at else 0.0
    return Usage(counted, finished, active, device_s, wall_s, since)


def trials_after(session: Session, study: Study, after: int = -1, limit: int = 1000) -> list[Trial]:
    """Trials numbered above `after`, in order (incremental polling)."""
    q = (
        select(Trial).where(Trial.study_id == study.id, Trial.number > after)
        .order_by(Trial.number).limit(limit)
    )  # fmt: skip
    return list(session.scalars(q))


def trial_counts(session: Session, study_ids: list[int]) -> dict[int, dict[TrialState, int]]:
    """{study id: {trial state: count}} in one query."""
    out: dict[int, dict[TrialState, int]] = {i: {} for i in study_ids}
    if not study_ids:
        return out
    q = (
        select(Trial.study_id, Trial.state, func.count()).where(Trial.study_id.in_(study_ids))
        .group_by(Trial.study_id, Trial.state)
    )  # fmt: skip
    for study_id, state, n in session.execute(q):
        out[study_id][state] = n
    return out
