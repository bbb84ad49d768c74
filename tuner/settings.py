"""Settings from the environment (TUNER_ prefix)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Settings:
    database_url: str
    work_dir: Path

    @classmethod
    def from_env(cls) -> Settings:
        cwd = Path.cwd()
        return cls(
            database_url=os.environ.get("TUNER_DATABASE_URL", f"sqlite:///{cwd / 'tuner.db'}"),
            work_dir=Path(os.environ.get("TUNER_WORK_DIR", cwd / "runs")),
        )
