from __future__ import annotations

import os
from pathlib import Path

import pytest

# Fixtures that run another framework's own code on our exports in a subprocess (torchtitan's
# ConfigManager, Megatron's validate_args and interleaved schedule; tests/tuner/test_export.py):
# a test that uses one is marked `external` (in make test, not make test-fast).
EXTERNAL_FIXTURES = {"torchtitan_parsed", "megatron_schedules", "megatron_src"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if EXTERNAL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.external)


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Trials cache the measured CPU peak; keep the suite's cache out of the user's home. The CLI's
    default database is ./tuner.db, where `make demo` leaves a study and its calibration: a CLI
    test that names no database reads an empty one of its own instead."""
    os.environ.setdefault("TUNER_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    os.environ.setdefault("TUNER_DATABASE_URL", f"sqlite:///{tmp_path_factory.mktemp('db') / 'tuner.db'}")


@pytest.fixture(scope="session")
def postgres_url():
    from tests.postgres import postgres_server

    with postgres_server() as url:
        yield url


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request, tmp_path: Path) -> str:
    """Every store test runs on both databases."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'tuner.db'}"
    url = request.getfixturevalue("postgres_url")
    # A fresh schema per test: drop everything the previous test left.
    from sqlalchemy import create_engine, text

    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text("DROP SCHEMA public CASCADE; CREATE SCHEMA public"))
    engine.dispose()
    return url


@pytest.fixture(scope="session")
def slurm_cluster():
    """A real single-node Slurm cluster with accounting (scripts/slurm-local.sh), shared by the
    session. Fails, never skips, where it cannot start: a missing cluster is a broken test setup."""
    from tests.slurm_cluster import slurm_cluster

    with slurm_cluster() as cluster:
        yield cluster


@pytest.fixture(scope="session")
def slurm_cluster_4():
    """Four nodes of 2 CPUs, each its own network namespace and hostname, links between nodes
    shaped to 200 Mbit/s (scripts/slurm-local.sh --nodes 4), for tests marked `multinode`."""
    from tests.slurm_cluster import slurm_cluster

    with slurm_cluster(nodes=4, inter_node_mbit=200) as cluster:
        yield cluster
