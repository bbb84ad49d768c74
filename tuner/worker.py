"""Workers: the processes that hold studies and run them.

- `run_worker` (`tuner worker`): claims studies one after another: PENDING ones (not paused), and
  RUNNING or CANCELLING ones whose lease expired (their worker died): those resume where they
  were, re-attaching to jobs that still run. Several workers may share one PostgreSQL database
  (the claim is a conditional UPDATE: of two workers claiming one study, one wins). A worker
  told to stop (SIGTERM/SIGINT) hands its study back: running trials are stopped and re-queued.
- `run_in_allocation` (`tuner alloc-run`, inside a Slurm allocation): the study's trials as srun
  steps until the study ends or the allocation is about to; then it hands the study back.
- `follow_allocations` (`tuner run` in allocation mode): submits allocations and watches them
  until the study ends.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable

from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import sessionmaker

from tuner import store
from tuner.backoff import Backoff, retrying
from tuner.db import DatabaseError, connect
from tuner.dispatch import DispatchError, close_dispatcher, make_dispatcher
from tuner.lease import Lease
from tuner.loop import StudyRunner, run_study
from tuner.outcome import StudyStatus
from tuner.settings import Settings
from tuner.spec import StudySpec

log = logging.getLogger("tuner.worker")


def run_worker(
    settings: Settings,
    *,
    once: bool = False,
    exit_when_idle: bool = False,
    poll_s: float = 2.0,
    backend: str | None = None,
    stop: threading.Event | None = None,
    on_claim: Callable[[int, str], None] | None = None,
    sessions: sessionmaker | None = None,
) -> int:
    """Run studies until stopped (or idle, or one study with `once`); returns how many ran. A
    database that does not answer (yet, or any more) is waited for, never a reason to exit."""
    stop = stop or threading.Event()
    sessions = sessions or _connect(settings.database_url, stop, poll_s)
    if sessions is None:
        return 0
    owner = store.Owner.this_process("worker")
    ran = 0
    while not stop.is_set():
        try:
            with sessions.begin() as s:
                study = store.claim_next(s, owner, lease_s=settings.lease_s)
                claimed = (study.id, study.name) if study else None
        except OperationalError as e:  # the database restarts: look again later
            log.warning("cannot claim a study (database: %s)", str(e).splitlines()[0])
            stop.wait(poll_s)
            continue
        if claimed is None:
            if once or exit_when_idle:
                return ran
            stop.wait(poll_s)
            continue
        study_id, name = claimed
        if on_claim:
            on_claim(study_id, name)
        log.info("running study %d", study_id)
        _run_claimed(sessions, study_id, owner, settings, backend, stop)
        ran += 1
        if once:
            return ran
    return ran


def _connect(url: str, stop: threading.Event, poll_s: float) -> sessionmaker | None:
    """Connect (and migrate), retrying with back-off (from min(poll_s, 1) s, doubling, up to 30 s
    between tries) while the database is unreachable; None if told to stop first. A malformed URL
    is still an error at once."""
    if stop.is_set():
        return None
    try:
        return retrying(
            lambda: connect(url), on=lambda e: isinstance(e, DatabaseError) and "cannot reach" in str(e),
            delays=Backoff(min(poll_s, 1.0) or 1.0, 30.0).delays(), wait=stop.wait,
            log=lambda e, delay: log.warning("%s; retrying in %.0f s", e, delay),
        )  # fmt: skip
    except DatabaseError:
        if stop.is_set():
            return None
        raise


def _run_claimed(sessions, study_id: int, owner: store.Owner, settings: Settings, backend, stop) -> None:
    with Lease(sessions, study_id, owner, settings.lease_s) as lease:
        try:
            with sessions() as s:
                spec = StudySpec.model_validate(store.study_by_id(s, study_id).spec)
            dispatcher = make_dispatcher(spec, backend, site=settings.slurm.site())
            try:
                status = StudyRunner(sessions, study_id, dispatcher, settings.work_dir, lease,
                                     should_yield=stop.is_set, spec=spec).run()  # fmt: skip
            finally:
                close_dispatcher(dispatcher)
            log.info("study %d: %s", study_id, status.word)
        except Exception as e:  # a broken study must not take the worker down
            log.error("study %d failed: %s", study_id, traceback.format_exc())
            try:
                with sessions.begin() as s:
                    store.finish(s, study_id, owner, StudyStatus.FAILED, f"{type(e).__name__}: {e}"[:2000])
            except OperationalError:
                pass  # the lease expires; the next worker resumes the study


def run_in_allocation(study_id: int, *, margin_s: float | None = None) -> StudyStatus:
    """Inside a Slurm allocation: run the study with an SrunDispatcher until it ends, or hand it
    back `margin_s` before the allocation ends."""
    from tuner.dispatch.allocation import SrunDispatcher, allocation_end, allocation_nodes

    settings = Settings.from_env()
    sessions = connect(settings.database_url)
    with sessions() as s:
        study = store.get_study(s, study_id)
        if study is None:
            raise SystemExit(f"no study with id {study_id}")
        spec = StudySpec.model_validate(study.spec)
    margin_s = margin_s if margin_s is not None else spec.slurm.allocation_margin_s
    job = os.environ.get("SLURM_JOB_ID")
    end = allocation_end(job) if job else None
    dispatcher = SrunDispatcher(
        nodes=allocation_nodes(), devices_per_node=spec.cluster.gpus_per_node,
        gpu=spec.device == "cuda", end=end, margin_s=margin_s, env={**spec.slurm.env}, python=sys.executable,
    )  # fmt: skip
    return run_study(sessions, study_id, dispatcher, settings.work_dir, owner=store.Owner.this_process("alloc"),
                     lease_s=settings.lease_s, poll_s=0.5, spec=spec,
                     should_yield=lambda: dispatcher.time_left() < margin_s)  # fmt: skip


MAX_ALLOCATIONS = 20
ALLOCATION_RETRY = Backoff(first_s=30.0, cap_s=30.0)  # a refused allocation: again every 30 s


def follow_allocations(
    sessions: sessionmaker, study_id: int, spec: StudySpec, settings: Settings, *,
    on_finished: Callable[[int], None] = lambda n: None, should_stop: Callable[[], bool] = lambda: False,
    say: Callable[[str], None] = print,
) -> StudyStatus:  # fmt: skip
    """Allocation mode: submit an allocation that runs the study, follow the study in the
    database and the allocation through the Slurm dispatcher, and submit the next allocation
    when one ends with the study unfinished (handed back). Ctrl-C cancels the study (its runner
    stops its steps)."""
    from tuner.dispatch.allocation import submit_allocation
    from tuner.dispatch.slurm import SlurmDispatcher

    env = {"TUNER_DATABASE_URL": settings.database_url, "TUNER_WORK_DIR": str(settings.work_dir.resolve())}
    site, watcher, job, submitted, refused = settings.slurm.site(), SlurmDispatcher(), None, 0, 0
    while True:
        with sessions() as s:
            study = store.study_by_id(s, study_id, refresh=True)
            status = store.status_of(study)
            on_finished(store.usage(s, study).finished)
        if status.is_final:
            return status
        if should_stop():
            with sessions.begin() as s:
                say(store.cancel(s, study_id, "cancelled from the CLI (Ctrl-C)").message)
            should_stop = lambda: False  # noqa: E731
        if job is None or watcher.poll(job).done:
            if submitted >= MAX_ALLOCATIONS:
                return status
            try:
                job = submit_allocation(study_id, spec, settings.work_dir, site=site, env=env)
            except DispatchError as e:
                refused += 1
                delay = ALLOCATION_RETRY.delay(refused)
                say(f"  allocation not submitted ({e}); trying again in {delay:.0f} s")
                job = None
                time.sleep(delay)
                continue
            submitted, refused = submitted + 1, 0
            say(f"  allocation {job.id} submitted ({spec.slurm.allocation_minutes} min)")
        time.sleep(2)
