"""Studies: creation, the status state machine, and leases.

`transition()` is the only code that writes `studies.status`: one conditional UPDATE
(`... WHERE status IN (allowed)`, plus the lease holder where the move is the holder's) that
says whether it took. Everything else here is a named move built on it.

A lease (owner id, host, pid, expiry) says which worker runs a study; its heartbeat
(tuner/lease.py) renews the expiry. Another worker may take a RUNNING (or CANCELLING) study
only once the lease expired, or at once when the owner is a process on this host that no longer
exists. Times are the workers' clocks in UTC: hosts sharing a database keep them within a few
seconds of each other (NTP), well inside the lease (default 60 s).
"""

from __future__ import annotations

import datetime as dt
import os
import socket
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

from sqlalchemy import and_, func, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from tuner.db import Study, Trial, aware, utcnow
from tuner.models import model_key
from tuner.outcome import ACTIVE_TRIAL, StudyStatus, allowed_from
from tuner.spec import StudySpec
from tuner.store.trials import cancel_waiting

DEFAULT_LEASE_S = 60.0
HELD = (StudyStatus.RUNNING, StudyStatus.CANCELLING)  # the statuses a lease holds


class StudyExists(ValueError):
    pass


def create_study(session: Session, spec: StudySpec) -> Study:
    """A PENDING study row; its name must be new."""
    m = spec.as_model_config()
    study = Study(
        name=spec.name, spec=spec.model_dump(mode="json"), status=StudyStatus.PENDING, sampler=spec.sampler,
        model_key=model_key(m, spec.model.preset),
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
    """By id (a number), else by name."""
    if isinstance(name_or_id, int) or str(name_or_id).isdigit():
        found = session.get(Study, int(name_or_id))
        if found is not None:
            return found
    return session.scalars(select(Study).where(Study.name == str(name_or_id))).one_or_none()


def study_by_id(session: Session, study_id: int, *, refresh: bool = False) -> Study | None:
    """The study with this id; `refresh`: read again even if this session holds it (its status
    and lease move under other sessions' conditional UPDATEs)."""
    return session.get(Study, study_id, populate_existing=refresh)


def studies_by_id(session: Session, study_ids: Iterable[int]) -> list[Study]:
    ids = list(set(study_ids))
    return list(session.scalars(select(Study).where(Study.id.in_(ids)).order_by(Study.id))) if ids else []


def list_studies(session: Session) -> list[Study]:
    return list(session.scalars(select(Study).order_by(Study.id)))


def latest_study_on(session: Session, cluster_key: str) -> Study | None:
    """The study created last on this cluster."""
    q = (
        select(Study)
        .where(Study.cluster_key == cluster_key)
        .order_by(Study.created_at.desc(), Study.id.desc())
    )
    return session.scalars(q.limit(1)).first()


def delete_study(session: Session, study: Study) -> None:
    """A study and, by cascade, its trials and bests (the caller checked it is finished)."""
    session.delete(study)
    session.flush()


def ping(session: Session) -> None:
    """One round trip to the database (the health check)."""
    session.execute(select(Study.id).limit(1))


def find_studies(
    session: Session, *, status: StudyStatus | None = None, model: str | None = None, cluster: str | None = None,
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


def status_of(study: Study) -> StudyStatus:
    return StudyStatus(study.status)  # the column is typed: already a StudyStatus once loaded


# --- the one writer of studies.status ----------------------------------------------------------


def transition(
    session: Session, study_id: int, to: StudyStatus, *, where=(), now: dt.datetime | None = None, **values
) -> bool:
    """Move the study to `to` if its status allows it (STUDY_TRANSITIONS) and every extra
    condition in `where` holds; returns whether it took. Entering a final status sets
    finished_at once and ends the lease."""
    now = now or utcnow()
    row = {"status": to, **values}
    if to.is_final:  # the last holder stays on the row (who ran it); the lease ends
        row |= {"finished_at": func.coalesce(Study.finished_at, now), "resume_after": None,
                "lease_expires_at": None}  # fmt: skip
    stmt = (
        update(Study)
        .where(Study.id == study_id, Study.status.in_(allowed_from(to)), *where)
        .values(**row)
        .execution_options(synchronize_session=False)
    )
    took = session.execute(stmt).rowcount == 1
    session.expire_all()  # objects loaded before the UPDATE are stale now
    return took


_NO_LEASE = {"lease_owner": None, "lease_host": None, "lease_pid": None, "lease_expires_at": None,
             "lease_renewed_at": None}  # fmt: skip


# --- leases ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Owner:
    """Who holds a lease: a unique id, plus where it runs (for people and for liveness)."""

    id: str
    host: str
    pid: int

    @classmethod
    def this_process(cls, role: str = "worker") -> Owner:
        host, pid = socket.gethostname(), os.getpid()
        return cls(f"{role}@{host}:{pid}:{uuid.uuid4().hex[:6]}", host, pid)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie counts as dead
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def owner_gone(study: Study) -> bool:
    """The lease holder is a process on this host that no longer runs: its lease is void."""
    return (
        study.lease_owner is not None
        and study.lease_host == socket.gethostname()
        and study.lease_pid is not None
        and not _pid_alive(study.lease_pid)
    )


def lease_expired(study: Study, now: dt.datetime | None = None) -> bool:
    expires = aware(study.lease_expires_at)
    return study.lease_owner is None or expires is None or expires <= (now or utcnow()) or owner_gone(study)


def describe_lease(study: Study, now: dt.datetime | None = None) -> str:
    """'worker@host:123:ab12cd (renewed 3 s ago, expires in 57 s)' or why there is none."""
    if study.lease_owner is None:
        return "no lease"
    now = now or utcnow()
    renewed = (now - aware(study.lease_renewed_at)).total_seconds() if study.lease_renewed_at else None
    left = (aware(study.lease_expires_at) - now).total_seconds() if study.lease_expires_at else 0.0
    age = f"renewed {renewed:.0f} s ago, " if renewed is not None else ""
    state = "process gone" if owner_gone(study) else (f"expires in {left:.0f} s" if left > 0 else
                                                      f"expired {-left:.0f} s ago")  # fmt: skip
    return f"{study.lease_owner} ({age}{state})"


def _lease_values(owner: Owner, now: dt.datetime, lease_s: float) -> dict:
    return {"lease_owner": owner.id, "lease_host": owner.host, "lease_pid": owner.pid,
            "lease_renewed_at": now, "lease_expires_at": now + dt.timedelta(seconds=lease_s)}  # fmt: skip


class ClaimRefused(RuntimeError):
    """The study is held by a live owner, finished, or paused; the message says which."""


def claim(
    session: Session, study_id: int, owner: Owner, *, lease_s: float = DEFAULT_LEASE_S,
    takeover: bool = True, ignore_pause: bool = False, now: dt.datetime | None = None,
) -> StudyStatus:  # fmt: skip
    """Take the study: PENDING -> RUNNING, or a RUNNING/CANCELLING one whose lease expired (only
    with `takeover`) or whose owner's process is gone. Returns the status now held; raises
    ClaimRefused naming the reason (the owner, with its lease age)."""
    now = now or utcnow()
    study = session.get(Study, study_id, populate_existing=True)
    if study is None:
        raise ClaimRefused(f"no study with id {study_id}")
    status = status_of(study)
    if status.is_final:
        raise ClaimRefused(f"study {study.name!r} already ended: {status.word}")
    lease = _lease_values(owner, now, lease_s)
    if status is StudyStatus.PENDING:
        resume = aware(study.resume_after)
        if resume is not None and resume > now and not ignore_pause:
            raise ClaimRefused(f"study {study.name!r} is paused until {resume:%H:%M:%S} UTC: {study.error}")
        took = transition(session, study_id, StudyStatus.RUNNING, now=now, where=[Study.status == StudyStatus.PENDING],
                          started_at=func.coalesce(Study.started_at, now), resume_after=None, **lease)  # fmt: skip
        held = StudyStatus.RUNNING
    else:
        if study.lease_owner == owner.id:
            return status
        gone = owner_gone(study)
        if not (lease_expired(study, now) and (takeover or gone)):
            held_by = describe_lease(study, now)
            hint = "" if lease_expired(study, now) else "; wait for it to end or expire"
            raise ClaimRefused(f"study {study.name!r} is {status.word} under {held_by}{hint}")
        # Compare-and-set on the owner we saw, so two takers cannot both win.
        same = Study.lease_owner == study.lease_owner if study.lease_owner else Study.lease_owner.is_(None)
        fresh = (
            [same] if gone else [same, or_(Study.lease_expires_at.is_(None), Study.lease_expires_at <= now)]
        )
        took = transition(session, study_id, status, now=now, where=fresh, **lease)
        held = status
    if not took:
        raise ClaimRefused(f"study {study.name!r} was taken by another worker at the same moment")
    return held


def claim_next(
    session: Session, owner: Owner, *, lease_s: float = DEFAULT_LEASE_S, now: dt.datetime | None = None
) -> Study | None:
    """The oldest study a worker may run now, claimed: PENDING (not paused), or RUNNING/
    CANCELLING with an expired lease or a dead owner on this host. The candidates are read without
    locks; the conditional UPDATE of `claim` decides (on PostgreSQL a second worker's UPDATE of the
    same row waits for the first's commit, then finds it taken and moves to the next candidate).
    Not FOR UPDATE SKIP LOCKED: that locks every candidate read, and a worker looking at the same
    moment sees none and, with --exit-when-idle, leaves with work still queued."""
    now = now or utcnow()
    runnable = or_(
        and_(Study.status == StudyStatus.PENDING, or_(Study.resume_after.is_(None), Study.resume_after <= now)),
        and_(Study.status.in_(HELD),
             or_(Study.lease_expires_at.is_(None), Study.lease_expires_at <= now,
                 Study.lease_host == socket.gethostname())),
    )  # fmt: skip
    q = select(Study).where(runnable).order_by(Study.id).limit(20)
    for study in session.scalars(q).all():
        if study.status is not StudyStatus.PENDING and not lease_expired(study, now):
            continue  # on this host and alive
        try:
            claim(session, study.id, owner, lease_s=lease_s, now=now)
        except ClaimRefused:
            continue
        return session.get(Study, study.id, populate_existing=True)
    return None


def renew(session: Session, study_id: int, owner: Owner, *, lease_s: float = DEFAULT_LEASE_S,
          now: dt.datetime | None = None) -> bool:  # fmt: skip
    """The heartbeat: extend the lease if we still hold it. False: it was taken over (or the
    study ended); the holder must stop."""
    now = now or utcnow()
    stmt = (
        update(Study)
        .where(Study.id == study_id, Study.lease_owner == owner.id, Study.status.in_(HELD))
        .values(lease_renewed_at=now, lease_expires_at=now + dt.timedelta(seconds=lease_s))
        .execution_options(synchronize_session=False)
    )
    return session.execute(stmt).rowcount == 1


def holds(session: Session, study_id: int, owner: Owner) -> bool:
    return session.scalar(select(Study.lease_owner).where(Study.id == study_id)) == owner.id


def release(
    session: Session, study_id: int, owner: Owner, *, reason: str | None = None,
    resume_after: dt.datetime | None = None, now: dt.datetime | None = None,
) -> bool:  # fmt: skip
    """RUNNING -> PENDING by its holder: handed back (a worker stopping, an allocation ending), or
    paused until `resume_after` with the reason."""
    return transition(session, study_id, StudyStatus.PENDING, now=now, where=[Study.lease_owner == owner.id],
                      error=reason, resume_after=resume_after, **_NO_LEASE)  # fmt: skip


def finish(
    session: Session, study_id: int, owner: Owner, status: StudyStatus, reason: str | None = None,
    *, now: dt.datetime | None = None,
) -> bool:  # fmt: skip
    """RUNNING -> COMPLETE | FAILED, or CANCELLING -> CANCELLED, by its holder. A cancel reason
    already stored is kept."""
    values = {} if status is StudyStatus.CANCELLED else {"error": reason}
    return transition(session, study_id, status, now=now, where=[Study.lease_owner == owner.id], **values)


@dataclass(frozen=True)
class CancelResult:
    took: bool
    status: StudyStatus  # after the call
    message: str


def cancel(session: Session, study_id: int, reason: str, *, now: dt.datetime | None = None) -> CancelResult:
    """Ask a study to stop. A PENDING study with nothing running ends CANCELLED at once (its
    queued trials end `cancelled`); otherwise it becomes CANCELLING and its lease holder (or the
    next worker, once the lease expired) stops its trials and ends it CANCELLED. The first
    reason is kept; cancelling a cancelling or finished study changes nothing."""
    now = now or utcnow()
    study = session.get(Study, study_id, populate_existing=True)
    status = status_of(study)
    if status.is_final:
        return CancelResult(
            False, status, f"study {study.name!r} already ended ({status.word}); nothing to cancel"
        )
    if status is StudyStatus.CANCELLING:
        return CancelResult(False, status, f"study {study.name!r} is already being cancelled: {study.error}")
    active = session.scalar(
        select(func.count()).where(Trial.study_id == study_id, Trial.state.in_(ACTIVE_TRIAL))
    )  # fmt: skip
    if status is StudyStatus.PENDING and not active:
        took = transition(session, study_id, StudyStatus.CANCELLED, now=now, where=[Study.status == StudyStatus.PENDING],
                          error=reason)  # fmt: skip
        if took:
            cancel_waiting(session, study_id, f"not run: {reason}", now=now)
    else:
        took = transition(session, study_id, StudyStatus.CANCELLING, now=now,
                          where=[Study.status == status], error=reason)  # fmt: skip
    if not took:  # it moved under us: say where it is now
        return cancel(session, study_id, reason, now=now)
    after = StudyStatus.CANCELLED if status is StudyStatus.PENDING and not active else StudyStatus.CANCELLING
    return CancelResult(True, after, f"study {study.name!r} {after.word}")


def count_dispatch_failure(session: Session, study_id: int, *, reset: bool = False) -> int:
    """Consecutive failed submissions (reset by a successful one); returns the new count."""
    value = 0 if reset else Study.dispatch_failures + 1
    session.execute(update(Study).where(Study.id == study_id).values(dispatch_failures=value)
                    .execution_options(synchronize_session=False))  # fmt: skip
    return session.scalar(select(Study.dispatch_failures).where(Study.id == study_id)) or 0
