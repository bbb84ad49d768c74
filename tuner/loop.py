"""The study runner: one study, held through a lease, to its end.

    StudyRunner(sessions, study_id, dispatcher, work_dir, lease).run() -> the study's status

`run()` loads the spec, the valid space and a sampler replayed from the stored trials, then
repeats, every `poll_s`:
  1. refresh      read the study (status, our lease) and its unfinished trials
  2. handle stop  CANCELLING (or told to stop): end every trial, CANCELLED; the lease lost: stop
                  at once; told to yield (a worker stopping, an allocation ending): re-queue,
                  hand back
  3. reconcile    trials left SUBMITTING by a crash: found by job name, or re-queued
  4. collect      poll running jobs; an ended attempt is retried as the same trial or finishes
                  the trial, and the sampler is told (tuner/outcome.py: retry, feedback)
  5. start        queued trials first, then new layouts from the sampler, while the budget
                  (derived from stored rows: tuner/budget.py) and free devices allow; each
                  trial gets a floor (trial.prune_running_fraction x the best tokens/s measured
                  at its device count) below which it prunes itself while running; a failed
                  submission re-queues the trial with back-off, and after
                  `trial.max_dispatch_failures` in a row the study pauses (PENDING)
  6. finish       nothing left to run: COMPLETE (the model is calibrated on the measurements)

The database is the truth and the runner the one writer of its study's trials; everything it
keeps in memory (the sampler, job handles, back-off times) is a cache rebuilt on restart. A
database that stops answering (a restart) pauses the loop until it answers again.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import sessionmaker

from trainer.contract.trial_dir import LOG_FILE
from tuner import store
from tuner.backoff import Backoff, retrying
from tuner.budget import may_add_trial, stop_reason
from tuner.calibration import calibrate_study
from tuner.db import Trial, utcnow
from tuner.dispatch import Dispatcher, DispatchError, JobHandle
from tuner.lease import Lease
from tuner.outcome import FailureKind, Outcome, StudyStatus, TrialState, feedback, retry
from tuner.pricing import Pricing
from tuner.samplers import make_sampler
from tuner.space import SearchSpace
from tuner.spec import StudySpec, benchmark_config, slug

log = logging.getLogger("tuner.loop")
MAX_BACKOFF_S = 300.0  # a failed submission's re-queue: dispatch_backoff_s x 2^(n-1), at most this
DB_BACKOFF = Backoff(first_s=1.0, cap_s=30.0)  # the database away while running: 1, 2, 4, ... 30 s
STARTUP_DELAYS_S = (1, 2, 4, 8, 15, 30)  # ... and at start-up: about a minute, then the error


@dataclass
class Progress:
    """What a progress bar shows; updated after every finished trial."""

    finished: int = 0
    budget: int = 0
    best_tokens_per_s: float = 0.0
    best_layout: str = ""
    last: str = ""
    events: list[str] = field(default_factory=list)


class StudyRunner:
    def __init__(
        self, sessions: sessionmaker, study_id: int, dispatcher: Dispatcher, work_dir: Path, lease: Lease, *,
        poll_s: float = 0.2, on_progress: Callable[[Progress], None] | None = None,
        should_yield: Callable[[], bool] = lambda: False, should_stop: Callable[[], bool] = lambda: False,
        clock: Callable[[], dt.datetime] = utcnow,
        sleep: Callable[[float], None] = time.sleep, spec: StudySpec | None = None,
    ) -> None:  # fmt: skip
        self.sessions, self.study_id, self.dispatcher, self.work_dir = (
            sessions,
            study_id,
            dispatcher,
            work_dir,
        )
        self.lease, self.owner, self.poll_s, self.on_progress = lease, lease.owner, poll_s, on_progress
        self.should_yield, self.should_stop, self.clock, self.sleep = should_yield, should_stop, clock, sleep
        self.not_before: dict[int, dt.datetime] = {}  # trial id -> no new submission before
        self.exhausted = False
        self.progress = Progress()
        self.spec = spec  # the caller's parsed spec (a worker's), else parsed from the row in load()

    # --- the steps ---------------------------------------------------------------------------

    def run(self) -> StudyStatus:
        """Run the study to its end, a hand-back or a pause; returns its status then (RUNNING if
        the lease was lost: someone else runs it now)."""
        if (status := self._retrying(self.load, STARTUP_DELAYS_S)) is not None:
            return status
        while True:  # a database that restarts: wait for it, lose nothing
            if (status := self._retrying(self.step, DB_BACKOFF.delays())) is not None:
                return status
            self.sleep(self.poll_s)

    def load(self) -> StudyStatus | None:
        with self.sessions() as s:
            study = store.study_by_id(s, self.study_id)
            self.spec = self.spec or StudySpec.model_validate(study.spec)
            history = [(store.config_of(t), store.outcome_of(t)) for t in store.trials(s, study)]
            stored = store.latest_constants(s, self.spec.cluster.name)
        # One pricing for the study: its dtype is the trials' (StudySpec.trial_dtype), its
        # constants the cluster's latest calibration or the device kind's defaults.
        self.pricing = Pricing.for_study(self.spec, stored)
        space = SearchSpace.from_spec(self.spec).enumerate()
        if not space.valid:
            reasons = "; ".join(
                f"{space.examples[r]} ({n} layouts)" for r, n in space.rejected.most_common(3)
            )
            return self._end(StudyStatus.FAILED, f"no valid layout in the space: {reasons}")
        self.sampler = make_sampler(self.spec.sampler, space.valid, seed=self.spec.seed, pricing=self.pricing)
        for config, outcome in history:
            self.sampler.replay(config, outcome)
            if outcome is not None and outcome.ok and outcome.tokens_per_s > self.progress.best_tokens_per_s:
                self.progress.best_tokens_per_s = outcome.tokens_per_s
                self.progress.best_layout = config.describe()
        self.progress.budget = self.spec.budget.max_trials
        return None

    def step(self) -> StudyStatus | None:
        """One pass of the loop; a status when the runner is done with the study."""
        with self.sessions() as s:
            study = store.study_by_id(s, self.study_id, refresh=True)
            status, holder = store.status_of(study), study.lease_owner
        if (
            self.lease.lost.is_set()
            or holder != self.owner.id
            or status not in (StudyStatus.RUNNING, StudyStatus.CANCELLING)
        ):
            log.warning(
                "study %d: lease lost (now %s, held by %s); stopping", self.study_id, status.word, holder
            )
            return StudyStatus.RUNNING if status is StudyStatus.RUNNING else status
        if status is StudyStatus.RUNNING and self.should_stop():  # Ctrl-C on `tuner run`
            with self.sessions.begin() as s:
                store.cancel(s, self.study_id, "cancelled from the command line (Ctrl-C)", now=self.clock())
            status = StudyStatus.CANCELLING
        if status is StudyStatus.CANCELLING:
            return self.cancel_all()
        if self.should_yield():
            return self.hand_back()
        self.reconcile()
        self.collect()
        if (paused := self.start()) is not None:
            return paused
        return self.finish_if_done()

    def reconcile(self) -> None:
        """A trial left SUBMITTING (this or an earlier runner died, or the database failed,
        between the submission and the commit of its handle): find its job by name."""
        for trial in self._trials(TrialState.SUBMITTING):
            name = store.job_name(self.study_id, trial.number, trial.attempts)
            job = self.dispatcher.find(name, self._trial_dir(trial))
            with self.sessions.begin() as s:
                trial = store.trial_by_id(s, trial.id)
                if job is not None:
                    store.attach_job(s, trial, str(job), str(self._trial_dir(trial) / LOG_FILE))
                else:
                    store.submission_failed(
                        s, trial, f"no job named {name} was found after a restart; re-queued"
                    )

    def collect(self) -> None:
        for trial in self._trials(TrialState.RUNNING):
            job = JobHandle.parse(trial.job_id)
            report = self.dispatcher.poll(job)
            with self.sessions.begin() as s:
                trial = store.trial_by_id(s, trial.id)
                if not report.done:
                    store.note_job_state(s, trial, report.state)
                    continue
                told = self._end_attempt(s, trial, report.outcome, report.state)
            if told is not None:
                self._told(*told)

    def start(self) -> StudyStatus | None:
        """Start trials while the budget and the devices allow; a status if the study paused."""
        b = self.spec.budget
        while True:
            with self.sessions() as s:
                study = store.study_by_id(s, self.study_id)
                used = store.usage(s, study, min_improvement=b.early_stop_min_improvement, now=self.clock())
                waiting = store.trials(s, study, (TrialState.WAITING,))
            now = self.clock()
            eligible = [t for t in waiting if self.not_before.get(t.id, now) <= now]
            if used.active >= b.trials_in_flight or stop_reason(b, used):
                return None
            # Queued trials first; no new layout while one waits out a back-off.
            trial = (eligible[0] if eligible else None) if waiting else self._new_trial(used)
            if trial is None:
                return None
            cfg = benchmark_config(self.spec, store.config_of(trial), self._best_at(store.world_size(trial)))
            if not self.dispatcher.can_start(cfg):
                return None
            if (paused := self._submit(trial, cfg)) is not None:
                return paused

    def finish_if_done(self) -> StudyStatus | None:
        with self.sessions() as s:
            study = store.study_by_id(s, self.study_id)
            used = store.usage(
                s, study, min_improvement=self.spec.budget.early_stop_min_improvement, now=self.clock()
            )
            waiting = store.trials(s, study, (TrialState.WAITING,))
        reason = stop_reason(self.spec.budget, used)
        if used.active:
            return None
        if reason is None and (waiting or (may_add_trial(self.spec.budget, used) and not self.exhausted)):
            return None
        with self.sessions.begin() as s:
            if waiting:
                store.cancel_waiting(s, self.study_id, f"not run: {reason}", now=self.clock())
            calibrate_study(s, store.study_by_id(s, self.study_id), self.pricing)
        return self._end(StudyStatus.COMPLETE, reason)

    # --- stopping --------------------------------------------------------------------------------

    def cancel_all(self) -> StudyStatus:
        """CANCELLING -> every running job cancelled, every trial ended, CANCELLED."""
        for trial in self._trials(TrialState.RUNNING, TrialState.SUBMITTING):
            job = (JobHandle.parse(trial.job_id) if trial.job_id else
                   self.dispatcher.find(store.job_name(self.study_id, trial.number, trial.attempts),
                                        self._trial_dir(trial)))  # fmt: skip
            if job is not None:
                self.dispatcher.cancel(job)
            with self.sessions.begin() as s:
                trial = store.trial_by_id(s, trial.id)
                outcome = Outcome.failed(FailureKind.CANCELLED, "the study was cancelled")
                if trial.state is TrialState.SUBMITTING:
                    store.submission_failed(s, trial, "the study was cancelled before its job was known")
                else:
                    store.end_attempt(
                        s, trial, outcome, requeue=False, told=feedback(outcome), now=self.clock()
                    )
        with self.sessions.begin() as s:
            store.cancel_waiting(s, self.study_id, "not run: the study was cancelled", now=self.clock())
        return self._end(StudyStatus.CANCELLED, None)

    def hand_back(self, reason: str | None = None, resume_after: dt.datetime | None = None,
                  keep_running: bool = False) -> StudyStatus:  # fmt: skip
        """RUNNING -> PENDING for the next worker. Running trials are stopped and re-queued
        (not failed, no retry used), unless `keep_running` (a pause: the next holder re-attaches)."""
        self.reconcile()
        if not keep_running:
            for trial in self._trials(TrialState.RUNNING):
                self.dispatcher.cancel(JobHandle.parse(trial.job_id))
                outcome = Outcome.failed(
                    FailureKind.CANCELLED, "handed back: the worker or allocation stopped"
                )
                with self.sessions.begin() as s:
                    store.end_attempt(
                        s, store.trial_by_id(s, trial.id), outcome, requeue=True, now=self.clock()
                    )
        with self.sessions.begin() as s:
            store.release(
                s, self.study_id, self.owner, reason=reason, resume_after=resume_after, now=self.clock()
            )
        self.lease.stop()
        return StudyStatus.PENDING

    # --- helpers ---------------------------------------------------------------------------------

    def _new_trial(self, used: store.Usage) -> Trial | None:
        """Ask the sampler for a layout; predicted not to fit -> PRUNED (told), ask again. The
        stored prediction is the one the sampler chose it by (not priced again)."""
        while may_add_trial(self.spec.budget, used) and not self.exhausted:
            config = self.sampler.ask()
            if config is None:
                self.exhausted = True
                return None
            est = self.sampler.estimate(config)
            with self.sessions.begin() as s:
                study = store.study_by_id(s, self.study_id)
                trial = store.add_trial(s, study, config, est.to_dict(), TrialState.WAITING)
                if not (self.spec.prune_predicted_oom and not est.fits):
                    return trial
                reason = (f"predicted {est.memory_bytes / 2**30:.2f} GiB > {self.spec.cluster.device_memory_gb:g} GB "
                          f"device memory (margin {self.pricing.constants.memory_margin:.0%})")  # fmt: skip
                store.prune_trial(s, trial, reason, now=self.clock())
            self.sampler.tell(config, Outcome.failed(FailureKind.PREDICTED_OOM, reason))
        return None

    def _submit(self, trial: Trial, cfg) -> StudyStatus | None:
        with self.sessions.begin() as s:
            trial = store.trial_by_id(s, trial.id)
            if not store.begin_attempt(s, trial, now=self.clock()):
                return None  # changed under us; the next pass sees it
            name, work_dir = (
                store.job_name(self.study_id, trial.number, trial.attempts),
                self._trial_dir(trial),
            )
        try:
            job = self.dispatcher.submit(
                cfg, name=name, work_dir=work_dir, timeout_s=self.spec.trial.timeout_s
            )
        except DispatchError as e:
            return self._submission_failed(trial.id, str(e))
        with self.sessions.begin() as s:
            store.attach_job(s, store.trial_by_id(s, trial.id), str(job), str(work_dir / LOG_FILE))
            store.count_dispatch_failure(s, self.study_id, reset=True)
        self.not_before.pop(trial.id, None)
        return None

    def _submission_failed(self, trial_id: int, message: str) -> StudyStatus | None:
        t = self.spec.trial
        with self.sessions.begin() as s:
            store.submission_failed(s, store.trial_by_id(s, trial_id), message, now=self.clock())
            failures = store.count_dispatch_failure(s, self.study_id)
        delay = Backoff(t.dispatch_backoff_s, MAX_BACKOFF_S).delay(failures)
        self.not_before[trial_id] = self.clock() + dt.timedelta(seconds=delay)
        log.warning("study %d: submission failed (%d in a row), trial re-queued for %.0f s: %s", self.study_id,
                    failures, delay, message)  # fmt: skip
        if failures < t.max_dispatch_failures:
            return None
        reason = f"paused after {failures} failed submissions in a row; last: {message}"[:2000]
        resume = self.clock() + dt.timedelta(seconds=t.dispatch_pause_s)
        return self.hand_back(reason, resume_after=resume, keep_running=True)

    def _end_attempt(self, s, trial: Trial, outcome: Outcome, job_state: str):
        """Retry the trial or finish it; returns (config, outcome, number) to tell, or None."""
        t = self.spec.trial
        if retry(
            outcome, store.previous_kinds(trial), max_retries=t.max_retries, crash_retries=t.crash_retries
        ):
            store.end_attempt(s, trial, outcome, requeue=True, job_state=job_state, now=self.clock())
            log.info("study %d trial %d: attempt %d %s; re-queued", self.study_id, trial.number, trial.attempts,
                     outcome.kind)  # fmt: skip
            return None
        if not store.end_attempt(s, trial, outcome, requeue=False, told=feedback(outcome), job_state=job_state,
                                 now=self.clock()):  # fmt: skip
            return None
        return store.config_of(trial), outcome, trial.number

    def _told(self, config, outcome: Outcome, number: int) -> None:
        """After the trial's end is committed: the sampler learns it, the progress shows it."""
        self.sampler.tell(config, outcome)
        p = self.progress
        p.finished += 1
        if outcome.ok and outcome.tokens_per_s > p.best_tokens_per_s:
            p.best_tokens_per_s, p.best_layout = outcome.tokens_per_s, config.describe()
        p.last = f"trial {number}: {config.describe()} -> " + (
            f"{outcome.tokens_per_s:.0f} tokens/s" + (" (pruned while running)" if outcome.pruned else "")
            if outcome.ok
            else outcome.kind
        )
        if self.on_progress:
            self.on_progress(p)

    def _best_at(self, world_size: int) -> float | None:
        """The best tokens/s measured so far in this study at `world_size` devices."""
        with self.sessions() as s:
            return store.best_at(s, self.study_id, world_size)

    def _trials(self, *states: TrialState) -> list[Trial]:
        with self.sessions() as s:
            return store.trials(s, store.study_by_id(s, self.study_id), states)

    def _trial_dir(self, trial: Trial) -> Path:
        return self.work_dir / slug(self.spec.name) / f"trial-{trial.number:04d}"

    def _end(self, status: StudyStatus, reason: str | None) -> StudyStatus:
        with self.sessions.begin() as s:
            took = store.finish(s, self.study_id, self.owner, status, reason, now=self.clock())
        self.lease.stop()
        return status if took else StudyStatus.RUNNING

    def _retrying(self, fn, delays):
        """fn() with the database allowed to be away for the `delays` (tuner/backoff.py)."""

        def unavailable(e: BaseException, delay: float) -> None:
            log.warning("study %d: database unavailable (%s); retrying in %.0f s", self.study_id,
                        str(e).splitlines()[0], delay)  # fmt: skip

        return retrying(fn, on=OperationalError, delays=delays, wait=self.sleep, log=unavailable)


def run_study(
    sessions: sessionmaker, study: str | int, dispatcher: Dispatcher, work_dir: Path, *,
    owner: store.Owner | None = None, lease_s: float = store.DEFAULT_LEASE_S, takeover: bool = False,
    **kwargs,
) -> StudyStatus:  # fmt: skip
    """Claim the study (see store.claim: refused while another live owner holds it) and run it
    under a lease with its heartbeat. Returns the status it ended in."""
    owner = owner or store.Owner.this_process("run")
    with sessions.begin() as s:
        found = store.get_study(s, study)
        if found is None:
            raise ValueError(f"no study named {study!r}")
        if store.status_of(found).is_final:
            return store.status_of(found)
        study_id = found.id
        store.claim(s, study_id, owner, lease_s=lease_s, takeover=takeover)
    with Lease(sessions, study_id, owner, lease_s) as lease:
        return StudyRunner(sessions, study_id, dispatcher, work_dir, lease, **kwargs).run()
