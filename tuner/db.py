"""The database: SQLAlchemy 2.0 typed models, the engine, and Alembic migrations.

SQLite by default (one file under the working directory); PostgreSQL through the same URL for
many workers. The schema is created and upgraded only by Alembic (tuner/migrations).

Every transaction of a `connect()` session that wrote anything bumps `store_revision.n` as its
last statement, in the same transaction (`_count_writes`): (epoch, n) names one state of the
database, and readers key their caches on it (tuner/cache.py), so a cached read is never older
than the database it came from. A write by hand, outside these sessions, must bump it too (or
restart the API)."""

from __future__ import annotations

import datetime as dt
import enum
import threading
import time
from pathlib import Path
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Enum,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    create_engine,
    event,
    update,
)
from sqlalchemy.engine import Engine
from sqlalchemy.exc import ArgumentError, OperationalError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, relationship, sessionmaker

from trainer.contract.axes import AXES
from tuner.outcome import FailureKind, Feedback, StudyStatus, TrialState

MIGRATIONS = Path(__file__).resolve().parent / "migrations"


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def aware(t: dt.datetime | None) -> dt.datetime | None:
    """Every time we store is UTC; SQLite hands datetimes back without their zone."""
    return t.replace(tzinfo=dt.UTC) if t is not None and t.tzinfo is None else t


def _states(cls: type[enum.StrEnum]) -> Enum:
    """A column typed by one of tuner/outcome.py's enums: rows hold the member's value, the same
    VARCHAR(16) strings as before the columns were typed (no CHECK constraint, no native enum
    type: no migration), and a string that is no member's value is refused before it is written."""
    return Enum(cls, native_enum=False, create_constraint=False, length=16, validate_strings=True,
                values_callable=lambda members: [m.value for m in members])  # fmt: skip


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON}  # noqa: RUF012


class Study(Base):
    __tablename__ = "studies"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    spec: Mapped[dict[str, Any]]
    status: Mapped[StudyStatus] = mapped_column(_states(StudyStatus), index=True, default=StudyStatus.PENDING)
    sampler: Mapped[str] = mapped_column(String(16))
    # Keys for "best layout per model size": the preset (or shape), its size, the cluster, devices.
    model_key: Mapped[str] = mapped_column(String(100), index=True)
    num_params: Mapped[int] = mapped_column(BigInteger, index=True)
    cluster_key: Mapped[str] = mapped_column(String(100), index=True)
    num_gpus: Mapped[int] = mapped_column(index=True)
    # Why the study is in its status: the failure, the first cancel request, a pause.
    error: Mapped[str | None] = mapped_column(Text)
    # The lease (tuner/store/studies.py): who runs the study and until when, renewed by its
    # heartbeat. Another worker may take the study only once lease_expires_at has passed.
    lease_owner: Mapped[str | None] = mapped_column(String(200))
    lease_host: Mapped[str | None] = mapped_column(String(255))
    lease_pid: Mapped[int | None]
    lease_expires_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    lease_renewed_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    resume_after: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))  # a paused study
    dispatch_failures: Mapped[int] = mapped_column(default=0)  # in a row; reset by a submission
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    started_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))  # first claim
    finished_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))

    trials: Mapped[list[Trial]] = relationship(
        back_populates="study", order_by="Trial.number", cascade="all, delete-orphan", passive_deletes=True
    )


class Trial(Base):
    __tablename__ = "trials"
    __table_args__ = (
        UniqueConstraint("study_id", "number"),
        UniqueConstraint("study_id", "layout_key"),  # a layout runs at most once per study
        Index("ix_trials_study_state_tps", "study_id", "state", "tokens_per_s"),
        Index("ix_trials_study_state_world_tps", "study_id", "state", "world_size", "tokens_per_s"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    study_id: Mapped[int] = mapped_column(ForeignKey("studies.id", ondelete="CASCADE"), index=True)
    number: Mapped[int]
    state: Mapped[TrialState] = mapped_column(_states(TrialState), index=True)
    layout_key: Mapped[str] = mapped_column(String(300))
    config: Mapped[dict[str, Any]]
    # One column per parallel axis (trainer/contract/axes.py: added below, `_axis_columns`), and
    # two derived from the layout: dp (dp_replicate x dp_shard) and world_size, the devices the
    # trial holds (ParallelConfig.world_size, cp included: migration 0010), so SQL can group by
    # device count (bests, budgets) without knowing which axes multiply the world.
    dp: Mapped[int]
    world_size: Mapped[int]
    predicted: Mapped[dict[str, Any] | None]
    predicted_tokens_per_s: Mapped[float | None] = mapped_column(Float)
    predicted_memory_bytes: Mapped[float | None] = mapped_column(Float)
    # Measured (COMPLETE)
    tokens_per_s: Mapped[float | None] = mapped_column(Float, index=True)
    tflops_per_device: Mapped[float | None] = mapped_column(Float)
    mfu: Mapped[float | None] = mapped_column(Float)
    peak_memory_bytes: Mapped[int | None] = mapped_column(BigInteger)
    step_time_median_s: Mapped[float | None] = mapped_column(Float)
    step_time_min_s: Mapped[float | None] = mapped_column(Float)
    step_time_max_s: Mapped[float | None] = mapped_column(Float)
    result: Mapped[dict[str, Any] | None]
    # Failed, or pruned before running (predicted_oom)
    failure_kind: Mapped[FailureKind | None] = mapped_column(_states(FailureKind))
    failure_message: Mapped[str | None] = mapped_column(Text)
    # Pruned while running (too slow next to the best): why it stopped early. Not a failure: its
    # partial measurement is in the metric columns above (migration 0008).
    stop_reason: Mapped[str | None] = mapped_column(Text)
    # Dispatch
    job_id: Mapped[str | None] = mapped_column(String(600))
    job_state: Mapped[str | None] = mapped_column(String(32))  # the scheduler's word (Slurm state)
    log_path: Mapped[str | None] = mapped_column(String(500))
    attempts: Mapped[int] = mapped_column(default=0)
    # One entry per ended attempt: {"attempt", "job", "job_state", "kind", "message", "started_at",
    # "ended_at", "device_s"}; device_s sums them (the device-hours budget).
    attempt_log: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON)
    device_s: Mapped[float] = mapped_column(Float, default=0.0)
    told: Mapped[Feedback | None] = mapped_column(_states(Feedback))  # what the sampler heard
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    started_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))

    study: Mapped[Study] = relationship(back_populates="trials")


_SQL_TYPES = {int: Integer, bool: Boolean, str: lambda: String(32)}


def _axis_columns() -> None:
    """Trial's axis columns, from the axis table: a new axis is a new column with no edit here
    (its migration adds it to existing databases, server default the axis's default)."""
    for axis in AXES:
        default = {True: "1", False: "0"}.get(axis.default, str(axis.default))
        column = mapped_column(axis.name, _SQL_TYPES[axis.type](), nullable=False, server_default=default)
        setattr(Trial, axis.name, column)


_axis_columns()
Index("ix_trials_layout", Trial.tp, Trial.pp, Trial.dp, Trial.micro_batch_size)


class StudyBest(Base):
    """The fastest completed trial of a study per device count, kept as trials finish
    (tuner.store.finish_trial), so "best per model size" reads a few rows, not every trial."""

    __tablename__ = "study_bests"

    study_id: Mapped[int] = mapped_column(ForeignKey("studies.id", ondelete="CASCADE"), primary_key=True)
    world_size: Mapped[int] = mapped_column(primary_key=True)
    trial_id: Mapped[int] = mapped_column(ForeignKey("trials.id", ondelete="CASCADE"))
    tokens_per_s: Mapped[float] = mapped_column(Float)


class Calibration(Base):
    """Performance-model constants fitted to the measured trials of a study, per cluster. The
    latest row for a cluster is the prior of its next study and of `tuner plan`."""

    __tablename__ = "calibrations"

    id: Mapped[int] = mapped_column(primary_key=True)
    cluster_key: Mapped[str] = mapped_column(String(100), index=True)
    constants: Mapped[dict[str, Any]]
    num_points: Mapped[int]
    rms_log_error: Mapped[float] = mapped_column(Float)  # of the fit on its own points
    study_id: Mapped[int | None] = mapped_column(ForeignKey("studies.id", ondelete="SET NULL"))
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class StoreRevision(Base):
    """One row (id 1): `n`, bumped by every committed write, and `epoch`, random, set when the
    table was created, so a database made again at the same URL does not repeat an old (epoch, n)."""

    __tablename__ = "store_revision"

    id: Mapped[int] = mapped_column(primary_key=True)
    epoch: Mapped[str] = mapped_column(String(32))
    n: Mapped[int] = mapped_column(BigInteger)


_WROTE = "tuner.wrote"  # Session.info key: this transaction wrote


def _count_writes(factory: sessionmaker) -> None:
    """A write is an ORM flush that changed rows or any statement but a SELECT (text() included);
    the bump runs just before the commit, so on PostgreSQL its row lock is held only for the commit."""

    @event.listens_for(factory, "after_flush")
    def _flushed(session: Session, _context) -> None:
        session.info[_WROTE] = True

    @event.listens_for(factory, "do_orm_execute")
    def _executed(state) -> None:
        if not state.is_select:
            state.session.info[_WROTE] = True

    @event.listens_for(factory, "before_commit")
    def _bump(session: Session) -> None:
        session.flush()
        if session.info.pop(_WROTE, False):
            session.execute(update(StoreRevision).where(StoreRevision.id == 1).values(n=StoreRevision.n + 1))
            session.info.pop(_WROTE, None)

    @event.listens_for(factory, "after_soft_rollback")
    def _rolled_back(session: Session, _previous) -> None:
        session.info.pop(_WROTE, None)


class DatabaseError(RuntimeError):
    """The database URL is malformed or the server unreachable; one clear line."""


def make_engine(url: str) -> Engine:
    try:
        # A server's connection can go away (a restart): each is pinged when taken from the pool.
        # A SQLite file's cannot: no ping, ~0.04 ms less per request (api/reads.py).
        engine = create_engine(url, pool_pre_ping=not url.startswith("sqlite"))
    except (ArgumentError, ValueError) as e:
        raise DatabaseError(f"database URL {url!r} is not valid: {e}") from None
    except ModuleNotFoundError as e:
        raise DatabaseError(f"database URL {url!r} needs the driver {e.name!r}") from None
    if engine.dialect.name == "sqlite":

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(conn, _record) -> None:
            cur = conn.cursor()
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA journal_mode=WAL")  # readers (API, CLI) alongside the worker
            cur.execute("PRAGMA busy_timeout=10000")
            cur.close()

    return engine


_UPGRADE_LOCK = threading.Lock()


def upgrade(engine: Engine) -> None:
    """Create or migrate the schema to the latest revision (Alembic). One at a time per process:
    Alembic's `context` is a module-level proxy, and two threads upgrading at once (tuner serve's
    app and its embedded worker) tear it down under each other (KeyError: 'script')."""
    from alembic import command
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    for attempt in range(5):
        try:
            with _UPGRADE_LOCK, engine.begin() as conn:
                cfg.attributes["connection"] = conn
                command.upgrade(cfg, "head")
            return
        except OperationalError as e:
            # A new SQLite file: another process's first connection switching it to WAL while this
            # one creates the schema fails one of them at once, whatever the busy timeout (a
            # deadlock SQLite breaks, ~1 in 20 with two pollers). The migration rolled back whole
            # (SQLite's DDL is transactional): run it again.
            if "database is locked" in str(e.orig) and attempt < 4:
                time.sleep(0.05 * 2**attempt)
                continue
            raise DatabaseError(
                f"cannot reach the database at {engine.url!r}: {str(e.orig).strip().splitlines()[0]}"
            ) from None


def connect(url: str) -> sessionmaker:
    """Engine + schema at head + a session factory (whose writes bump the store's revision)."""
    engine = make_engine(url)
    upgrade(engine)
    factory = sessionmaker(engine, expire_on_commit=False)
    _count_writes(factory)
    return factory
