"""What every command module of the CLI shares: the console, one-line failures, the database."""

from __future__ import annotations

from typing import NoReturn

import typer
from rich.console import Console
from sqlalchemy.orm import sessionmaker

from tuner.db import DatabaseError, connect
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
