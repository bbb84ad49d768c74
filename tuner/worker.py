"""`tuner worker`: claim PENDING studies from the database and run them, one after another.

Several workers may share one PostgreSQL database: a study is claimed with FOR UPDATE SKIP
LOCKED (tuner.store.claim_next_pending), so no study runs twice. On SQLite run one worker. A
worker told to stop (SIGTERM/SIGINT) hands its study back: running trials are stopped and
re-queued, the study returns to PENDING for the next worker.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Callable

from tuner import store
from tuner.db import Study, connect
from tuner.dispatch import make_dispatcher
from tuner.loop import run_study
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
) -> int:
    """Run studies until stopped (or idle, or one study with `once`); returns how many ran."""
    stop = stop or threading.Event()
    sessions = connect(settings.database_url)
    ran = 0
    while not stop.is_set():
        with sessions.begin() as s:
            study = store.claim_next_pending(s)
            claimed = (study.id, study.name, study.spec) if study else None
        if claimed is None:
            if once or exit_when_idle:
                return ran
            stop.wait(poll_s)
            continue
        study_id, name, spec_data = claimed
        if on_claim:
            on_claim(study_id, name)
        log.info("running study %d", study_id)
        try:
            spec = StudySpec.model_validate(spec_data)
            status = run_study(sessions, name, make_dispatcher(spec, backend), settings.work_dir,
                               should_yield=stop.is_set)  # fmt: skip
            log.info("study %d: %s", study_id, status)
        except Exception as e:  # one broken study must not take the worker down
            log.error("study %d failed: %s", study_id, traceback.format_exc())
            with sessions.begin() as s:
                store.finish_study(s, s.get(Study, study_id), "FAILED", f"{type(e).__name__}: {e}"[:2000])
        ran += 1
        if once:
            return ran
        time.sleep(0)
    return ran
