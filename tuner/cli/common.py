"""What every command module of the CLI shares: the console, one-line failures, the database."""

from __future__ import annotations

from pathlib import Path
from typing import NoReturn

import typer
from rich.console import Console
from sqlalchemy.orm import sessionmaker

from tuner.db import DatabaseError, connect
from tuner.perfconstants import ModelConstants
from tuner.settings import Settings

console = Console()


def fail(message: str) -> NoReturn:
    """Bad input or an unreachable service: the message on stderr, exit code 2, no traceback."""
    typer.echo(message, err=True)
    raise typer.Exit(2)


def sessions(settings: Settings) -> sessionmaker:
    try:
        return connect(settings.database_url)
    except DatabaseError as e:
        fail(str(e))


def stored_constants(cluster_name: str) -> ModelConstants | None:
    """The constants the last study on this cluster fitted (the database of TUNER_DATABASE_URL),
    or None: plan never creates a database and works without one."""
    from tuner import store

    url = Settings.from_env().database_url
    if url.startswith("sqlite:///") and not Path(url.removeprefix("sqlite:///")).exists():
        return None
    try:
        with connect(url)() as s:
            return store.latest_constants(s, cluster_name)
    except DatabaseError:
        return None
