from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Trials cache the measured CPU peak; keep the suite's cache out of the user's home."""
    os.environ.setdefault("TUNER_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
