"""Plain query functions over a Session: the only place that knows the schema's shape.

The database is the source of truth: a running study's sampler is rebuilt from `trials()`; a
restarted worker finds RUNNING trials here and re-attaches or re-queues them."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, object_session

from trainer.config import ParallelConfig
from tuner.db import Calibration, Study, StudyBest, Trial, utcnow
from tuner.outcome import FailureKind, Outcome, TrialState
from tuner.perfmodel import ModelConstants
from tuner.spec import StudySpec


def layout_key(config: ParallelConfig) -> str:
    """A layout's identity within a study (all knobs, stable order)."""
    return json.dumps(config.to_dict(), sort_keys=True, separators=(",", ":"))


def config_of(trial: Trial) -> ParallelConfig:
    return ParallelConfig.from_dict(trial.config)


class StudyExists(ValueError):
    pass


def create_study(session: Session, spec: StudySpec) -> Study:
    """A PENDING study row; its name must be new."""
    m = spec.gpt()
    study = Study(
        name=spec.name, spec=spec.model_dump(mode="json"), status="PENDING", sampler=spec.sampler,
        model_key=spec.model.preset or f"L{m.num_layers}-h{m.hidden_size}-a{m.num_heads}",
        num_params=m.num_params, cluster_key=spec.cluster.name, num_gpus=spec.devices,
    )  # fmt: skip
    session.add(study)
    try:
        session.flush()
    except IntegrityError:
        session.rollback()
        raise StudyExists(f"a study named {spec.name!r} already exists") from None
    return study


def get_study(session: Session, name_or_id: str | int) -> Study | None:
    if isinstance(name_or_id, int) or str(name_or_id).isdigit():
        found = session.get(Study, int(name_or_id))
        if found is not None:
            return found
    return session.scalars(select(Study).where(Study.name == str(name_or_id))).one_or_none()


def list_studies(session: Session) -> list[Study]:
    return list(session.scalars(select(Study).order_by(Study.id)))


def claim_study(session: Session, study: Study) -> None:
    """PENDING (or an orphaned RUNNING one, on restart) -> RUNNING by this worker."""
    study.status = "RUNNING"
    study.started_at = study.started_at or utcnow()
    study.worker = f"{socket.gethostname()}:{os.getpid()}"


def release_study(study: Study) -> None:
    """RUNNING -> PENDING: this worker stops (its allocation ends); another one resumes it."""
    study.status, study.worker = "PENDING", None


def finish_study(session: Session, study: Study, status: str, error: str | None = None) -> None:
    study.status, study.error, study.finished_at = status, error, utcnow()


def trials(session: Session, study: Study, states: tuple[TrialState, ...] | None = None) -> list[Trial]:
    q = select(Trial).where(Trial.study_id == study.id).order_by(Trial.number)
    if states:
        q = q.where(Trial.state.in_([s.value for s in states]))
    return list(session.scalars(q))


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
        study_id=study.id, number=number, state=state.value, layout_key=layout_key(config),
        config=config.to_dict(), tp=config.tp, pp=config.pp, dp=config.dp,
        micro_batch_size=config.micro_batch_size, num_microbatches=config.num_microbatches,
        zero_stage=config.zero_stage, activation_checkpoint=config.activation_checkpoint,
        sequence_parallel=config.sequence_parallel, pp_schedule=config.pp_schedule,
        virtual_stages=config.virtual_stages, predicted=predicted,
        predicted_tokens_per_s=(predicted or {}).get("tokens_per_s"),
        predicted_memory_bytes=(predicted or {}).get("memory_bytes"),
    )  # fmt: skip
    session.add(trial)
    session.flush()
    return trial


def start_trial(trial: Trial, job_id: str, log_path: str) -> None:
    trial.state, trial.job_id, trial.log_path = TrialState.RUNNING.value, job_id, log_path
    trial.started_at, trial.attempts, trial.job_state = utcnow(), trial.attempts + 1, None


def requeue_trial(trial: Trial) -> None:
    """Back to WAITING (infrastructure failure, lost worker): it runs again, as the same trial."""
    trial.state, trial.job_id = TrialState.WAITING.value, None


def prune_trial(trial: Trial, reason: str) -> None:
    trial.state, trial.failure_kind, trial.failure_message = TrialState.PRUNED.value, "predicted_oom", reason
    trial.finished_at = utcnow()


def finish_trial(trial: Trial, outcome: Outcome) -> None:
    """COMPLETE with metrics, or FAIL with the kind; a finished trial is never changed again."""
    assert not TrialState(trial.state).is_finished(), f"trial {trial.number} already {trial.state}"
    trial.finished_at, trial.result = utcnow(), outcome.result or None
    if outcome.ok:
        times = sorted(outcome.result.get("step_times_s", [])) or [outcome.step_time_s]
        trial.state = TrialState.COMPLETE.value
        trial.tokens_per_s, trial.tflops_per_device, trial.mfu = (
            outcome.tokens_per_s,
            outcome.tflops_per_device,
            outcome.mfu,
        )
        trial.peak_memory_bytes = outcome.peak_memory_bytes
        trial.step_time_median_s, trial.step_time_min_s, trial.step_time_max_s = (
            outcome.step_time_s,
            times[0],
            times[-1],
        )
        _record_best(trial)
    else:
        trial.state = TrialState.FAIL.value
        trial.failure_kind = outcome.failure.value if outcome.failure else "crash"
        trial.failure_message = outcome.message[-4000:]


def _record_best(trial: Trial) -> None:
    """Keep study_bests current: this trial, if it is the study's fastest at its device count."""
    session = object_session(trial)
    if session is None or trial.id is None:
        return
    world = trial.tp * trial.pp * trial.dp
    row = session.get(StudyBest, (trial.study_id, world))
    if row is None:
        session.add(StudyBest(study_id=trial.study_id, world_size=world, trial_id=trial.id,
                              tokens_per_s=trial.tokens_per_s or 0.0))  # fmt: skip
    elif (trial.tokens_per_s or 0.0) > row.tokens_per_s:
        row.trial_id, row.tokens_per_s = trial.id, trial.tokens_per_s


# Rebuilds study_bests from the trials (the migration that adds it; bulk loaders). Ties: lowest id.
REBUILD_BESTS_SQL = """
DELETE FROM study_bests;
INSERT INTO study_bests (study_id, world_size, trial_id, tokens_per_s)
SELECT study_id, world, id, tokens_per_s FROM (
    SELECT id, study_id, tp * pp * dp AS world, tokens_per_s,
           ROW_NUMBER() OVER (PARTITION BY study_id, tp * pp * dp ORDER BY tokens_per_s DESC, id) AS r
    FROM trials WHERE state = 'COMPLETE' AND tokens_per_s IS NOT NULL
) ranked WHERE r = 1
"""


def rebuild_bests(session: Session) -> None:
    from sqlalchemy import text

    for statement in REBUILD_BESTS_SQL.strip().split(";"):
        session.execute(text(statement))


def outcome_of(trial: Trial) -> Outcome | None:
    """What the sampler is told about a finished trial (None while unfinished)."""
    state = TrialState(trial.state)
    if state == TrialState.COMPLETE:
        return Outcome(ok=True, tokens_per_s=trial.tokens_per_s or 0.0, tflops_per_device=trial.tflops_per_device or 0.0,
                       mfu=trial.mfu or 0.0, peak_memory_bytes=trial.peak_memory_bytes or 0,
                       step_time_s=trial.step_time_median_s or 0.0, result=trial.result or {})  # fmt: skip
    if state == TrialState.PRUNED:
        return Outcome.failed(FailureKind.OOM, trial.failure_message or "predicted out of memory")
    if state == TrialState.FAIL:
        return Outcome.failed(FailureKind(trial.failure_kind or "crash"), trial.failure_message or "")
    return None


@dataclass(frozen=True)
class Best:
    study: str
    model_key: str
    num_params: int
    cluster_key: str
    num_gpus: int
    trial_number: int
    config: dict[str, Any]
    tokens_per_s: float
    tflops_per_device: float | None
    mfu: float | None
    peak_memory_bytes: int | None
    predicted_tokens_per_s: float | None
    global_batch_size: int
    seq_len: int

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def best_trial(session: Session, study: Study) -> Trial | None:
    """The study's fastest completed trial (from study_bests: its best per device count)."""
    q = (
        select(Trial).join(StudyBest, StudyBest.trial_id == Trial.id).where(StudyBest.study_id == study.id)
        .order_by(StudyBest.tokens_per_s.desc(), Trial.number).limit(1)
    )  # fmt: skip
    return session.scalars(q).first()


def best_configs(
    session: Session, *, model: str | None = None, cluster: str | None = None, num_gpus: int | None = None
) -> list[Best]:
    """The fastest measured layout per (model, cluster, devices) across studies, from study_bests
    (a row per study and device count, kept as trials finish): a few rows, however many trials."""
    q = select(StudyBest, Study).join(Study, Study.id == StudyBest.study_id)
    if model:
        q = q.where(Study.model_key == model)
    if cluster:
        q = q.where(Study.cluster_key == cluster)
    if num_gpus:
        q = q.where(StudyBest.world_size == num_gpus)
    winners: dict[tuple, tuple[StudyBest, Study]] = {}
    for row, study in session.execute(q.order_by(StudyBest.tokens_per_s.desc(), StudyBest.trial_id)):
        winners.setdefault((study.model_key, study.cluster_key, row.world_size), (row, study))
    trials_ = {
        t.id: t
        for t in session.scalars(select(Trial).where(Trial.id.in_([r.trial_id for r, _ in winners.values()])))
    }
    best = []
    for row, study in winners.values():
        trial, spec = trials_[row.trial_id], study.spec
        best.append(Best(
            study=study.name, model_key=study.model_key, num_params=study.num_params,
            cluster_key=study.cluster_key, num_gpus=row.world_size, trial_number=trial.number,
            config=trial.config, tokens_per_s=trial.tokens_per_s or 0.0, tflops_per_device=trial.tflops_per_device,
            mfu=trial.mfu, peak_memory_bytes=trial.peak_memory_bytes,
            predicted_tokens_per_s=trial.predicted_tokens_per_s,
            global_batch_size=spec["training"]["global_batch_size"],
            seq_len=spec["training"].get("seq_len") or spec["model"]["seq_len"],
        ))  # fmt: skip
    return sorted(best, key=lambda b: (b.num_params, b.cluster_key, b.num_gpus))


# --- calibrations ------------------------------------------------------------------------------


def save_calibration(
    session: Session, cluster_key: str, constants: ModelConstants, num_points: int,
    rms_log_error: float, study: Study | None = None,
) -> Calibration:  # fmt: skip
    row = Calibration(
        cluster_key=cluster_key, constants=constants.to_dict(), num_points=num_points,
        rms_log_error=rms_log_error, study_id=study.id if study else None,
    )  # fmt: skip
    session.add(row)
    session.flush()
    return row


def latest_constants(session: Session, cluster_key: str) -> ModelConstants | None:
    """The constants last fitted on this cluster, or None."""
    q = (
        select(Calibration).where(Calibration.cluster_key == cluster_key)
        .order_by(Calibration.created_at.desc(), Calibration.id.desc()).limit(1)
    )  # fmt: skip
    row = session.scalars(q).first()
    if row is None:
        return None
    known = {f.name for f in dataclasses.fields(ModelConstants)}
    return ModelConstants(**{k: v for k, v in row.constants.items() if k in known})


# --- queries for the API and the workers -------------------------------------------------------

FINISHED_STUDY = ("COMPLETE", "FAILED", "CANCELLED")
# A study's status as the API, the CLI and the dashboard say it.
STATUS_WORDS = {"PENDING": "pending", "RUNNING": "running", "COMPLETE": "done", "CANCELLED": "cancelled",
                "FAILED": "failed"}  # fmt: skip


def find_studies(
    session: Session, *, status: str | None = None, model: str | None = None, cluster: str | None = None,
    limit: int = 50, offset: int = 0,
) -> tuple[list[Study], int]:  # fmt: skip
    """A page of studies (newest first) and the number matching."""
    q = select(Study)
    if status:
        q = q.where(Study.status == status)
    if model:
        q = q.where(Study.model_key == model)
    if cluster:
        q = q.where(Study.cluster_key == cluster)
    total = session.scalar(select(func.count()).select_from(q.subquery())) or 0
    rows = session.scalars(q.order_by(Study.id.desc()).limit(limit).offset(offset))
    return list(rows), total


def trial_counts(session: Session, study_ids: list[int]) -> dict[int, dict[str, int]]:
    """{study id: {trial state: count}} in one query."""
    out: dict[int, dict[str, int]] = {i: {} for i in study_ids}
    if not study_ids:
        return out
    q = (
        select(Trial.study_id, Trial.state, func.count()).where(Trial.study_id.in_(study_ids))
        .group_by(Trial.study_id, Trial.state)
    )  # fmt: skip
    for study_id, state, n in session.execute(q):
        out[study_id][state] = n
    return out


def trials_after(session: Session, study: Study, after: int = -1, limit: int = 1000) -> list[Trial]:
    """Trials numbered above `after`, in order (incremental polling)."""
    q = (
        select(Trial).where(Trial.study_id == study.id, Trial.number > after)
        .order_by(Trial.number).limit(limit)
    )  # fmt: skip
    return list(session.scalars(q))


def claim_next_pending(session: Session) -> Study | None:
    """The oldest PENDING study, now RUNNING by this worker; None when there is none. On
    PostgreSQL the row is locked with FOR UPDATE SKIP LOCKED, so concurrent workers never claim
    the same study; on SQLite the write lock of the transaction does it (one worker)."""
    q = select(Study).where(Study.status == "PENDING").order_by(Study.id).limit(1)
    if session.get_bind().dialect.name == "postgresql":
        q = q.with_for_update(skip_locked=True)
    study = session.scalars(q).first()
    if study is not None:
        claim_study(session, study)
        session.flush()
    return study


def state_counts(session: Session) -> tuple[dict[str, int], dict[str, int]]:
    """({study status: n}, {trial state: n}) for /metrics."""
    studies = dict(session.execute(select(Study.status, func.count()).group_by(Study.status)).all())
    trials_ = dict(session.execute(select(Trial.state, func.count()).group_by(Trial.state)).all())
    return studies, trials_


def finished_durations(session: Session, limit: int = 100_000) -> list[float]:
    """Seconds from start to end of finished trials (the latest `limit`), for /metrics."""
    q = (
        select(Trial.started_at, Trial.finished_at)
        .where(Trial.started_at.is_not(None), Trial.finished_at.is_not(None))
        .order_by(Trial.id.desc()).limit(limit)
    )  # fmt: skip
    return [(b - a).total_seconds() for a, b in session.execute(q)]


def best_rows(
    session: Session, *, model: str | None = None, cluster: str | None = None, num_gpus: int | None = None
) -> list[dict[str, Any]]:
    """best_configs() as the API and `tuner best --json` show it (one shape for both)."""
    rows = best_configs(session, model=model, cluster=cluster, num_gpus=num_gpus)
    ids = dict(
        session.execute(select(Study.name, Study.id).where(Study.name.in_([b.study for b in rows]))).all()
    )
    return [
        {"study_id": ids[b.study], "study": b.study, "model": b.model_key, "num_params": b.num_params,
         "cluster": b.cluster_key, "gpus": b.num_gpus, "trial_number": b.trial_number,
         "layout": ParallelConfig.from_dict(b.config).describe(), "config": b.config,
         "tokens_per_s": b.tokens_per_s, "tflops_per_device": b.tflops_per_device, "mfu": b.mfu,
         "peak_memory_bytes": b.peak_memory_bytes, "predicted_tokens_per_s": b.predicted_tokens_per_s}
        for b in rows
    ]  # fmt: skip
