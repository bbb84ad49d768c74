"""Plain query functions over a Session: the only code that knows the schema's shape, and the
only writer of study and trial states (compare-and-set UPDATEs that say whether they took).

The database is the source of truth: a runner rebuilds its sampler from `trials()`, derives its
budgets from `usage()`, and a worker that takes over a study finds its unfinished trials here."""

from tuner.db import Study, Trial
from tuner.store.results import (
    REBUILD_BESTS_SQL,
    Best,
    best_configs,
    best_rows,
    best_trial,
    finished_durations,
    latest_constants,
    rebuild_bests,
    save_calibration,
    state_counts,
)
from tuner.store.studies import (
    DEFAULT_LEASE_S,
    CancelResult,
    ClaimRefused,
    Owner,
    StudyExists,
    cancel,
    claim,
    claim_next,
    count_dispatch_failure,
    create_study,
    describe_lease,
    find_studies,
    finish,
    get_study,
    holds,
    lease_expired,
    list_studies,
    owner_gone,
    release,
    renew,
    status_of,
    transition,
)
from tuner.store.trials import (
    Usage,
    add_trial,
    attach_job,
    begin_attempt,
    cancel_waiting,
    config_of,
    end_attempt,
    job_name,
    layout_key,
    note_job_state,
    outcome_of,
    previous_kinds,
    prune_trial,
    submission_failed,
    trial_counts,
    trials,
    trials_after,
    usage,
    world_size,
)

__all__ = [
    "DEFAULT_LEASE_S", "REBUILD_BESTS_SQL", "Best", "CancelResult", "ClaimRefused", "Owner", "Study",
    "StudyExists", "Trial", "Usage", "add_trial", "attach_job", "begin_attempt", "best_configs", "best_rows",
    "best_trial", "cancel", "cancel_waiting", "claim", "claim_next", "config_of", "count_dispatch_failure",
    "create_study", "describe_lease", "end_attempt", "find_studies", "finish", "finished_durations",
    "get_study", "holds", "job_name", "latest_constants", "layout_key", "lease_expired", "list_studies",
    "note_job_state", "outcome_of", "owner_gone", "previous_kinds", "prune_trial", "rebuild_bests", "release",
    "renew", "save_calibration", "state_counts", "status_of", "submission_failed", "transition", "trial_counts", "trials",
    "trials_after", "usage", "world_size",
]  # fmt: skip
