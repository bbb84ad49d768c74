"""run_study(): ask -> estimate -> (prune | dispatch) -> poll -> classify -> tell -> store.

The database is the source of truth. On (re)start the sampler is rebuilt by replaying every
trial; RUNNING trials are re-attached through their job id (or re-queued if their process is
gone); WAITING trials run before anything new is asked. Every trial ends in exactly one final
state, and a layout runs at most once per study (a unique key in the database)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy.orm import sessionmaker

from trainer.config import BenchmarkConfig, ParallelConfig
from tuner import store
from tuner.db import Trial
from tuner.dispatch import Dispatcher
from tuner.outcome import FailureKind, Outcome, TrialState
from tuner.perfmodel import (
    Measurement,
    calibrate,
    estimate,
    fit_memory_scale,
    load_constants,
    rms_log_error,
)
from tuner.samplers import make_sampler
from tuner.space import SearchSpace
from tuner.spec import StudySpec, slug


@dataclass
class Progress:
    """What a progress bar shows; updated after every finished trial."""

    finished: int = 0
    budget: int = 0
    best_tokens_per_s: float = 0.0
    best_layout: str = ""
    last: str = ""
    events: list[str] = field(default_factory=list)


def benchmark_config(spec: StudySpec, config: ParallelConfig) -> BenchmarkConfig:
    t = spec.trial
    dtype = {"bf16": "bf16", "fp16": "bf16", "fp32": "fp32"}[spec.training.precision]
    return BenchmarkConfig(
        model=spec.gpt(), parallel=config, warmup_steps=t.warmup_steps, measure_steps=t.measure_steps,
        seed=spec.seed, device=t.device, dtype=dtype if t.device != "cpu" else "fp32",
        max_memory_bytes=int(spec.cluster.device_memory_bytes),
    )  # fmt: skip


def run_study(
    sessions: sessionmaker,
    study_name: str,
    dispatcher: Dispatcher,
    work_dir: Path,
    *,
    poll_s: float = 0.2,
    on_progress: Callable[[Progress], None] | None = None,
    should_stop: Callable[[], bool] = lambda: False,
    should_yield: Callable[[], bool] = lambda: False,
) -> str:
    """Run (or resume) a study to its end; returns its final status. `should_stop` cancels the
    study; `should_yield` hands it back unfinished (an allocation about to end): running trials
    are stopped and re-queued, not failed, and the study returns to PENDING for the next worker."""
    with sessions.begin() as s:
        study = store.get_study(s, study_name)
        if study is None:
            raise ValueError(f"no study named {study_name!r}")
        if study.status in ("COMPLETE", "FAILED", "CANCELLED"):
            return study.status
        spec = StudySpec.model_validate(study.spec)
        store.claim_study(s, study)
        study_id = study.id
        history = [
            (t.id, store.config_of(t), TrialState(t.state), store.outcome_of(t), t.job_id)
            for t in store.trials(s, study)
        ]

    model, cluster, precision = spec.gpt(), spec.cluster, spec.training.precision
    space = SearchSpace.from_spec(spec).enumerate()
    if not space.valid:
        reasons = "; ".join(f"{space.examples[r]} ({n} layouts)" for r, n in space.rejected.most_common(3))
        return _finish(sessions, study_id, "FAILED", f"no valid layout in the space: {reasons}")
    with sessions() as s:
        constants = store.latest_constants(s, cluster.name) or load_constants(cluster.name)
    sampler = make_sampler(spec.sampler, space.valid, seed=spec.seed, model=model, cluster=cluster,
                           precision=precision, constants=constants)  # fmt: skip
    progress = Progress(budget=spec.budget.max_trials)
    running: dict[int, str] = {}  # trial id -> job id
    job_states: dict[int, str] = {}  # trial id -> the scheduler's last word, as stored
    waiting: list[int] = []
    best = 0.0
    since_improvement = 0
    for trial_id, config, state, outcome, job_id in history:
        sampler.replay(config, outcome)
        if state == TrialState.RUNNING and job_id:
            running[trial_id] = job_id
        elif state in (TrialState.WAITING, TrialState.RUNNING):
            waiting.append(trial_id)
        if outcome is not None and outcome.ok:
            best = max(best, outcome.tokens_per_s)
        if state in (TrialState.COMPLETE, TrialState.FAIL):
            progress.finished += 1
    started = time.monotonic()
    device_s = 0.0
    exhausted = False

    def budget_left() -> bool:
        b = spec.budget
        if progress.finished + len(running) >= b.max_trials:
            return False
        if b.max_wall_time_s and time.monotonic() - started > b.max_wall_time_s:
            return False
        if b.max_device_hours and device_s / 3600 > b.max_device_hours:
            return False
        return not (b.early_stop_trials and since_improvement >= b.early_stop_trials)

    while True:
        if should_yield():
            for trial_id, job in running.items():
                dispatcher.cancel(job)
                with sessions.begin() as s:
                    store.requeue_trial(s.get(Trial, trial_id))
            with sessions.begin() as s:
                store.release_study(s.get(store.Study, study_id))
            return "PENDING"
        if should_stop() or _cancelled(sessions, study_id):
            for trial_id, job in running.items():
                dispatcher.cancel(job)
                with sessions.begin() as s:
                    store.finish_trial(
                        s.get(Trial, trial_id), Outcome.failed(FailureKind.CANCELLED, "study cancelled")
                    )
            return _finish(sessions, study_id, "CANCELLED", None)

        # Start trials while devices and budget allow: queued ones first, then new asks.
        while len(running) < spec.budget.trials_in_flight and budget_left():
            if waiting:
                trial_id = waiting.pop(0)
                with sessions.begin() as s:
                    config = store.config_of(s.get(Trial, trial_id))
            else:
                config = sampler.ask()
                if config is None:
                    exhausted = True
                    break
                est = estimate(model, config, cluster, precision, constants)
                with sessions.begin() as s:
                    study = s.get(store.Study, study_id)
                    if spec.prune_predicted_oom and not est.fits:
                        trial = store.add_trial(s, study, config, est.to_dict(), TrialState.PRUNED)
                        reason = (f"predicted {est.memory_bytes / 2**30:.1f} GiB > {cluster.device_memory_gb:g} GB "
                                  f"device memory (margin {constants.memory_margin:.0%})")  # fmt: skip
                        store.prune_trial(trial, reason)
                        sampler.tell(config, Outcome.failed(FailureKind.OOM, reason))
                        continue
                    trial_id = store.add_trial(s, study, config, est.to_dict(), TrialState.WAITING).id
            cfg = benchmark_config(spec, config)
            if not dispatcher.can_start(cfg):
                waiting.insert(0, trial_id)
                break
            with sessions.begin() as s:
                trial = s.get(Trial, trial_id)
                trial_dir = work_dir / slug(spec.name) / f"trial-{trial.number:04d}"
                job = dispatcher.submit(cfg, name=f"{slug(spec.name)}-{trial.number}", work_dir=trial_dir,
                                        timeout_s=spec.trial.timeout_s)  # fmt: skip
                store.start_trial(trial, job, str(trial_dir / "log.txt"))
            running[trial_id] = job

        # Collect finished trials.
        for trial_id, job in list(running.items()):
            outcome = dispatcher.poll(job)
            job_state = dispatcher.state(job) if hasattr(dispatcher, "state") else None
            if outcome is None:
                if job_state and job_states.get(trial_id) != job_state:
                    job_states[trial_id] = job_state
                    with sessions.begin() as s:
                        s.get(Trial, trial_id).job_state = job_state
                continue
            del running[trial_id]
            job_states.pop(trial_id, None)
            with sessions.begin() as s:
                trial = s.get(Trial, trial_id)
                trial.job_state = job_state or trial.job_state
                config = store.config_of(trial)
                elapsed = (time.time() - trial.started_at.timestamp()) if trial.started_at else 0.0
                device_s += elapsed * config.world_size
                if outcome.failure is FailureKind.INFRA and trial.attempts <= spec.trial.max_retries:
                    store.requeue_trial(trial)  # not the layout's fault: run it again, not told
                    waiting.append(trial_id)
                    continue
                store.finish_trial(trial, outcome)
                number = trial.number
            sampler.tell(config, outcome)
            progress.finished += 1
            if outcome.ok and outcome.tokens_per_s > best * (1 + spec.budget.early_stop_min_improvement):
                since_improvement = 0
            else:
                since_improvement += 1
            if outcome.ok and outcome.tokens_per_s > best:
                best = outcome.tokens_per_s
                progress.best_tokens_per_s, progress.best_layout = best, config.describe()
            progress.last = (f"trial {number}: {config.describe()} -> "
                             + (f"{outcome.tokens_per_s:.0f} tokens/s" if outcome.ok else outcome.failure.value))  # fmt: skip
            if on_progress:
                on_progress(progress)

        if not running and not waiting and (exhausted or not budget_left()):
            _save_calibration(sessions, study_id, spec, constants)
            return _finish(sessions, study_id, "COMPLETE", None)
        time.sleep(poll_s)


MIN_CALIBRATION_POINTS = 3


def _save_calibration(sessions: sessionmaker, study_id: int, spec: StudySpec, prior) -> None:
    """Fit the performance model to this study's measured trials, starting from the constants the
    study began with, and keep the result as the cluster's prior for its next study and plan."""
    with sessions.begin() as s:
        study = s.get(store.Study, study_id)
        measured = [t for t in store.trials(s, study, (TrialState.COMPLETE,)) if t.step_time_median_s]
        points = [
            Measurement(
                spec.gpt(), store.config_of(t), spec.cluster, t.step_time_median_s, spec.training.precision
            )
            for t in measured
        ]
        if len(points) < MIN_CALIBRATION_POINTS:
            return
        fitted = calibrate(points, prior)
        peaks = [
            (m, t.peak_memory_bytes) for m, t in zip(points, measured, strict=True) if t.peak_memory_bytes
        ]
        fitted = fit_memory_scale(peaks, fitted)
        store.save_calibration(
            s, spec.cluster.name, fitted, len(points), rms_log_error(points, fitted), study
        )


def _cancelled(sessions: sessionmaker, study_id: int) -> bool:
    with sessions() as s:
        return s.get(store.Study, study_id).status == "CANCELLED"


def _finish(sessions: sessionmaker, study_id: int, status: str, error: str | None) -> str:
    with sessions.begin() as s:
        store.finish_study(s, s.get(store.Study, study_id), status, error)
    return status
