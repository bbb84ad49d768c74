"""Settings from the environment (TUNER_ prefix)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

MAX_BODY_BYTES = 1 << 20  # the API refuses larger request bodies (413)


def _seconds(env, name: str, default: float) -> float:
    raw = env.get(name)
    try:
        value = float(raw) if raw else default
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{name} must be a number of seconds > 0, got {raw!r}")
    return value


def _flag(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Settings:
    database_url: str
    work_dir: Path
    # API (api/app.py). Writes need a bearer token when one is configured; without any token
    # configured the API refuses writes (503) unless `allow_anonymous_writes` (tests, a laptop).
    api_token: str | None = field(default=None, repr=False)
    api_tokens_file: Path | None = None  # lines "name:sha256(token) hex", for several users
    read_auth: bool = False  # reads need the token too
    cors_origins: tuple[str, ...] = ()  # empty: no CORS headers at all
    allow_anonymous_writes: bool = False
    max_body_bytes: int = MAX_BODY_BYTES
    url: str | None = None  # the client's server (TUNER_URL)
    # A worker's hold on a study: renewed every third of it; another worker may take the study
    # once it expired (tuner/store/studies.py).
    lease_s: float = 60.0

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        cwd = Path.cwd()
        tokens_file = env.get("TUNER_API_TOKENS_FILE")
        return cls(
            database_url=env.get("TUNER_DATABASE_URL", f"sqlite:///{cwd / 'tuner.db'}"),
            work_dir=Path(env.get("TUNER_WORK_DIR", cwd / "runs")),
            api_token=env.get("TUNER_API_TOKEN") or None,
            api_tokens_file=Path(tokens_file) if tokens_file else None,
            read_auth=_flag(env.get("TUNER_READ_AUTH")),
            cors_origins=tuple(o.strip() for o in env.get("TUNER_CORS_ORIGINS", "").split(",") if o.strip()),
            allow_anonymous_writes=_flag(env.get("TUNER_ALLOW_ANONYMOUS_WRITES")),
            url=env.get("TUNER_URL") or None,
            lease_s=_seconds(env, "TUNER_LEASE_S", 60.0),
        )
