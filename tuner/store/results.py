"""Results: the best layouts (per study, per model size), calibrations, and the service's
aggregate queries (the API's /metrics)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple

from sqlalchemy import Connection, case, func, select, text
from sqlalchemy.orm import Session

from trainer.contract.parallel import ParallelConfig
from tuner.db import Calibration, StoreRevision, Study, StudyBest, Trial, aware
from tuner.outcome import StudyStatus, TrialState
from tuner.payoff import Measured
from tuner.perfconstants import RETIRED, ModelConstants
from tuner.store.trials import TRIAL_WORLD

# Rebuilds study_bests from the trials (the migration that adds it; bulk loaders). Ties: lowest id.
REBUILD_BESTS_SQL = """
DELETE FROM study_bests;
INSERT INTO study_bests (study_id, world_size, trial_id, tokens_per_s)
SELECT study_id, world, id, tokens_per_s FROM (
    SELECT id, study_id, world_size AS world, tokens_per_s,
           ROW_NUMBER() OVER (PARTITION BY study_id, world_size ORDER BY tokens_per_s DESC, id) AS r
    FROM trials WHERE state = :complete AND tokens_per_s IS NOT NULL
) ranked WHERE r = 1
"""


def rebuild_bests(session: Session) -> None:
    for statement in REBUILD_BESTS_SQL.strip().split(";"):
        stmt = text(statement)
        if ":complete" in statement:
            stmt = stmt.bindparams(complete=TrialState.COMPLETE.value)
        session.execute(stmt)


def best_at(session: Session, study_id: int, world_size: int) -> float | None:
    """The best tokens/s measured so far in the study at `world_size` devices."""
    row = session.get(StudyBest, (study_id, world_size))
    return row.tokens_per_s if row is not None else None


def best_trials(session: Session, study_ids: list[int]) -> dict[int, Trial]:
    """Each study's fastest completed trial, in two queries whatever the number of studies."""
    if not study_ids:
        return {}
    fastest: dict[int, tuple[float, int]] = {}
    for row in session.scalars(select(StudyBest).where(StudyBest.study_id.in_(study_ids))):
        if row.study_id not in fastest or row.tokens_per_s > fastest[row.study_id][0]:
            fastest[row.study_id] = (row.tokens_per_s, row.trial_id)
    ids = [trial_id for _, trial_id in fastest.values()]
    trials_ = {t.id: t for t in session.scalars(select(Trial).where(Trial.id.in_(ids)))} if ids else {}
    return {study_id: trials_[trial_id] for study_id, (_, trial_id) in fastest.items()}


def payoff_inputs(
    session: Session, study_ids: list[int]
) -> tuple[dict[int, float], dict[int, list[Measured]]]:
    """What a payoff needs (tuner/payoff.py), per study: the device-seconds all its trials used,
    and its completed trials in proposal order (of equal predictions, the first guess is the one
    run first)."""
    spent = dict(session.execute(select(Trial.study_id, func.sum(Trial.device_s)).where(Trial.study_id.in_(study_ids))
                                 .group_by(Trial.study_id)).all())  # fmt: skip
    measured: dict[int, list[Measured]] = {i: [] for i in study_ids}
    q = (
        select(Trial.study_id, TRIAL_WORLD, Trial.tokens_per_s, Trial.predicted_tokens_per_s)
        .where(
            Trial.study_id.in_(study_ids), Trial.state == TrialState.COMPLETE, Trial.tokens_per_s.is_not(None)
        )
        .order_by(Trial.number)
    )
    for study_id, world, tokens, predicted in session.execute(q):
        measured[study_id].append(Measured(world, tokens, predicted))
    return {i: spent.get(i) or 0.0 for i in study_ids}, measured


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


def latest_calibration(
    session: Session, *, cluster_key: str | None = None, study_id: int | None = None
) -> Calibration | None:
    """The calibration last fitted on this cluster (or to this study), or None."""
    q = select(Calibration).order_by(Calibration.created_at.desc(), Calibration.id.desc()).limit(1)
    if cluster_key is not None:
        q = q.where(Calibration.cluster_key == cluster_key)
    if study_id is not None:
        q = q.where(Calibration.study_id == study_id)
    return session.scalars(q).first()


def constants_of(row: Calibration) -> ModelConstants:
    """A stored calibration's constants (fields this version no longer knows are dropped)."""
    known = {f.name for f in dataclasses.fields(ModelConstants)}
    return ModelConstants(**{k: v for k, v in row.constants.items() if k in known})


def calibrated_clusters(session: Session) -> list[str]:
    """The clusters with at least one calibration, by name."""
    return sorted(session.scalars(select(Calibration.cluster_key).distinct()))


def latest_constants(session: Session, cluster_key: str) -> ModelConstants | None:
    """The constants last fitted on this cluster, or None."""
    row = latest_calibration(session, cluster_key=cluster_key)
    return constants_of(row) if row is not None else None


def export_calibrations(session: Session) -> list[dict[str, Any]]:
    """Every calibration, oldest first, as plain data (`tuner calibrate export`)."""
    rows = session.scalars(select(Calibration).order_by(Calibration.created_at, Calibration.id))
    return [{"cluster": r.cluster_key, "constants": r.constants, "num_points": r.num_points,
             "rms_log_error": r.rms_log_error, "created_at": aware(r.created_at).isoformat()} for r in rows]  # fmt: skip


def import_calibrations(session: Session, rows: Any) -> int:
    """Add exported calibrations (their times kept, so the newest per cluster stays the prior);
    ValueError names the first bad row. Returns how many were added."""
    import datetime as dt

    known = {f.name for f in dataclasses.fields(ModelConstants)}
    if not isinstance(rows, list):
        raise ValueError("expected a list of calibrations (the output of `tuner calibrate export`)")
    for i, row in enumerate(rows):
        try:
            constants = {k: v for k, v in row["constants"].items() if k not in RETIRED}
            unknown = set(constants) - known
            if unknown:
                raise ValueError(f"unknown constants {sorted(unknown)}")
            ModelConstants(**constants)
            session.add(Calibration(cluster_key=str(row["cluster"]), constants=constants,
                                    num_points=int(row["num_points"]), rms_log_error=float(row["rms_log_error"]),
                                    created_at=dt.datetime.fromisoformat(row["created_at"])))  # fmt: skip
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"calibration {i}: {e}") from None
    session.flush()
    return len(rows)


# --- queries for the API -----------------------------------------------------------------------


def state_counts(session: Session) -> tuple[dict[StudyStatus, int], dict[TrialState, int]]:
    """({study status: n}, {trial state: n}) for /metrics."""
    studies = dict(session.execute(select(Study.status, func.count()).group_by(Study.status)).all())
    trials_ = dict(session.execute(select(Trial.state, func.count()).group_by(Trial.state)).all())
    return studies, trials_


def duration_histogram(session: Session, buckets: tuple[float, ...]) -> tuple[list[int], float, int]:
    """(cumulative count of finished trials at or under each bucket's seconds, total seconds,
    count) of the trials' last attempt, in one aggregate query (the API's /metrics)."""
    if session.get_bind().dialect.name == "sqlite":
        seconds = (func.julianday(Trial.finished_at) - func.julianday(Trial.started_at)) * 86400.0
    else:
        seconds = func.extract("epoch", Trial.finished_at - Trial.started_at)
    columns = [func.coalesce(func.sum(case((seconds <= le, 1), else_=0)), 0) for le in buckets]
    row = session.execute(
        select(*columns, func.coalesce(func.sum(seconds), 0.0), func.count())
        .where(Trial.started_at.is_not(None), Trial.finished_at.is_not(None))
    ).one()  # fmt: skip
    return [int(n) for n in row[: len(buckets)]], float(row[-2]), int(row[-1])


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


# --- the store's revision ------------------------------------------------------------------------


class Revision(NamedTuple):
    """One state of the database: its epoch and the number of committed writes (tuner/db.py)."""

    epoch: str
    n: int


_REVISION = select(StoreRevision.__table__.c.epoch, StoreRevision.__table__.c.n).where(
    StoreRevision.__table__.c.id == 1
)


def revision(db: Session | Connection) -> Revision:
    """Read on every cached request: a Core statement on a connection (a session's, or one from
    the pool without a session: ~0.1 ms, against ~0.3 ms for the same select through the ORM on
    SQLite here)."""
    conn = db.connection() if isinstance(db, Session) else db
    epoch, n = conn.execute(_REVISION).one()
    return Revision(epoch, n)
