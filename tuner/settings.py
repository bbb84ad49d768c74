"""Settings: one object, read once from the environment (TUNER_* variables) and passed down.

pydantic-settings does the reading and the checking; a bad value is one line naming the variable
(`SettingsError`). The Slurm site's defaults are their own section (TUNER_SLURM_*)."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Annotated

from pydantic import Field, PositiveFloat, PositiveInt, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from tuner.spec import _SLURM_CONSTRAINT, _SLURM_NAME, format_validation_error

MAX_BODY_BYTES = 1 << 20  # the API refuses larger request bodies (413)
_IFNAME = r"^[A-Za-z0-9_.:^,-]+$"


class SettingsError(ValueError):
    """A TUNER_* variable that does not validate; one line per bad variable, named."""


class SlurmSettings(BaseSettings):
    """A Slurm site's defaults (TUNER_SLURM_*); a study's `slurm` section overrides the names.
    `setup` is a file of shell lines run at the top of every job: an administrator's setting,
    never part of a spec a user submits."""

    model_config = SettingsConfigDict(env_prefix="TUNER_SLURM_", extra="ignore", frozen=True)

    # The same checks as a spec's names (tuner/spec.py: SlurmSpec).
    account: str | None = Field(None, pattern=_SLURM_NAME, max_length=64)
    partition: str | None = Field(None, pattern=_SLURM_NAME, max_length=128)
    qos: str | None = Field(None, pattern=_SLURM_NAME, max_length=64)
    constraint: str | None = Field(None, pattern=_SLURM_CONSTRAINT, max_length=128)
    setup: Path | None = None
    # The interpreter on the compute nodes. Unset: a trial job runs this process's own (the same path
    # on a shared file system), an exported script `python` from the job's PATH (site()).
    python: str | None = None
    # The interface ranks talk over: GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME in every job.
    socket_ifname: str | None = Field(None, pattern=_IFNAME)

    @field_validator("account", "partition", "qos", "constraint", "socket_ifname", "setup", "python",
                     mode="before")  # fmt: skip
    @classmethod
    def _empty_is_none(cls, v):
        return v or None

    def site(self, *, default_python: str = sys.executable):
        """The dispatch layer's frozen view of these settings; `default_python` when
        TUNER_SLURM_PYTHON is unset."""
        from tuner.dispatch.sbatch import SiteSettings

        try:
            setup = tuple(self.setup.read_text().splitlines()) if self.setup else ()
        except OSError as e:
            raise SettingsError(f"TUNER_SLURM_SETUP: cannot read {self.setup}: {e.strerror}") from None
        return SiteSettings(self.account, self.partition, self.qos, self.constraint, setup,
                            self.python or default_python, self.socket_ifname)  # fmt: skip


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TUNER_", extra="ignore", frozen=True)

    database_url: str = Field(default_factory=lambda: f"sqlite:///{Path.cwd() / 'tuner.db'}")
    work_dir: Path = Field(default_factory=lambda: Path.cwd() / "runs")
    # API (api/). Writes need a bearer token when one is configured; without any token configured
    # the API refuses writes (503) unless `allow_anonymous_writes` (tests, a laptop).
    api_token: str | None = Field(None, repr=False)
    api_tokens_file: Path | None = None  # lines "name:sha256(token) hex", for several users
    read_auth: bool = False  # reads need the token too
    cors_origins: Annotated[tuple[str, ...], NoDecode] = ()  # comma-separated; empty: no CORS headers
    allow_anonymous_writes: bool = False
    max_body_bytes: PositiveInt = MAX_BODY_BYTES
    url: str | None = None  # the client's server (TUNER_URL)
    # A worker's hold on a study: renewed every third of it; another worker may take the study
    # once it expired (tuner/store/studies.py).
    lease_s: PositiveFloat = 60.0
    slurm: SlurmSettings = Field(default_factory=SlurmSettings)

    @field_validator("cors_origins", mode="before")
    @classmethod
    def _comma_list(cls, v):
        return tuple(o.strip() for o in v.split(",") if o.strip()) if isinstance(v, str) else v

    @field_validator("api_token", "url", mode="before")
    @classmethod
    def _empty_is_none(cls, v):
        return v or None

    @classmethod
    def from_env(cls) -> Settings:
        """Read TUNER_* from the environment, checked; SettingsError names the variable of every
        bad value. Read once (the CLI's callback, `tuner serve`, a worker) and passed down."""
        try:
            return cls(slurm=SlurmSettings())
        except ValidationError as e:
            raise SettingsError(_env_names(format_validation_error(e), e.title)) from None


def _env_names(text: str, model: str) -> str:
    """'lease_s: Input should be ...' -> 'TUNER_LEASE_S: Input should be ...'."""
    prefix = "TUNER_SLURM_" if model == "SlurmSettings" else "TUNER_"
    return re.sub(
        r"^([a-z_.]+):", lambda m: prefix + m.group(1).replace(".", "_").upper() + ":", text, flags=re.M
    )
