"""The store's revision (tuner/db.py) and the reads kept on it (tuner/cache.py), on SQLite and on
a real PostgreSQL: every committed write moves the revision, nothing else does, and a kept value
is served only at the revision it was read at."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import text

from tests.records import OWNER, record_trial
from tuner import store
from tuner.cache import RevisionCache
from tuner.db import connect
from tuner.outcome import FailureKind, Outcome, StudyStatus

from .test_store import SPEC, A, B, ok


def test_every_committed_write_moves_the_revision_and_nothing_else_does(database_url: str) -> None:
    sessions = connect(database_url)

    def now() -> store.Revision:
        with sessions() as s:
            return store.revision(s)

    start = now()
    with sessions.begin() as s:  # an ORM insert
        study_id = store.create_study(s, SPEC).id
    after_create = now()
    assert after_create.epoch == start.epoch and after_create.n == start.n + 1
    with sessions.begin() as s:  # reads only
        store.list_studies(s)
        store.trials(s, store.study_by_id(s, study_id))
    with sessions() as s:  # written, not committed
        record_trial(s, store.study_by_id(s, study_id), A, ok(1.0))
    assert now() == after_create
    with pytest.raises(RuntimeError), sessions.begin() as s:  # written, rolled back
        record_trial(s, store.study_by_id(s, study_id), A, ok(1.0))
        raise RuntimeError("rolled back")
    assert now() == after_create
    moves = [
        lambda s: store.claim(s, study_id, OWNER),  # a conditional UPDATE (Core)
        lambda s: record_trial(s, store.study_by_id(s, study_id), A, ok(2.0)),
        lambda s: record_trial(s, store.study_by_id(s, study_id), B, Outcome.failed(FailureKind.OOM, "x")),
        lambda s: store.renew(s, study_id, OWNER),  # a lease heartbeat
        lambda s: store.finish(s, study_id, OWNER, StudyStatus.COMPLETE),
        lambda s: store.rebuild_bests(s),  # text() statements
        lambda s: store.delete_study(s, store.study_by_id(s, study_id)),
    ]
    for i, move in enumerate(moves):
        before = now()
        with sessions.begin() as s:
            move(s)
        assert now().n == before.n + 1, f"move {i} did not bump the revision"


def test_a_database_made_again_at_the_same_url_has_a_new_epoch(database_url: str) -> None:
    """So a reader's cache can never take the new database's revision n for the old one's."""
    sessions = connect(database_url)
    with sessions() as s:
        first = store.revision(s)
    engine = sessions.kw["bind"]
    if engine.dialect.name == "sqlite":
        engine.dispose()
        for suffix in ("", "-wal", "-shm"):
            Path(database_url.removeprefix("sqlite:///") + suffix).unlink(missing_ok=True)
    else:
        with engine.begin() as conn:
            conn.execute(text("DROP SCHEMA public CASCADE; CREATE SCHEMA public"))
        engine.dispose()
    with connect(database_url)() as s:
        again = store.revision(s)
    assert again.n == first.n == 0 and again.epoch != first.epoch


def test_a_kept_value_is_served_only_at_its_revision() -> None:
    cache: RevisionCache[str] = RevisionCache(max_entries=2)
    r1, r2, other = store.Revision("e", 1), store.Revision("e", 2), store.Revision("f", 1)
    built = []

    def build(value: str):
        return lambda: built.append(value) or value

    assert cache.get("k", r1, build("a")) == "a" and cache.get("k", r1, build("b")) == "a"
    assert cache.get("k", r2, build("c")) == "c"  # a write since: built again
    assert cache.get("k", r1, build("old")) == "old"  # a reader still at r1 gets a fresh read ...
    assert cache.get("k", r2, build("d")) == "c"  # ... which does not replace the newer value
    assert cache.get("k", other, build("e")) == "e"  # another database (epoch): its own value
    assert cache.get("big", r1, build("x" * 10), keep_if=lambda v: len(v) < 5) == "x" * 10
    assert cache.get("big", r1, build("y")) == "y"  # not kept: built again
    cache.get("k2", r1, build("f"))
    cache.get("k3", r1, build("g"))  # bounded: the least recently used ("k") is out
    assert cache.get("k", other, build("h")) == "h"
    assert built == ["a", "c", "old", "e", "x" * 10, "y", "f", "g", "h"]
    got = cache.get_many(["k2", "k3", "k4"], r1, lambda keys: {k: k.upper() for k in keys})
    assert got == {"k2": "K2", "k3": "g", "k4": "K4"}  # k2 was pushed out by k; built with k4


def test_the_revision_row_is_created_by_the_migration(database_url: str) -> None:
    with connect(database_url)() as s:
        (n_rows,) = s.execute(text("SELECT count(*) FROM store_revision")).one()
    assert n_rows == 1
