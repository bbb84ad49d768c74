"""`tuner serve`: registered into the `tuner` CLI through the `parallel_tuner.cli` entry point
(pyproject.toml), so the tuner package does not import the API. Imports of the web stack are
lazy: `tuner --help` works where only the core is installed."""

from __future__ import annotations

import threading
from typing import Annotated

import typer

from tuner.cli.common import fail


def serve(
    ctx: typer.Context,
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port")] = 8000,
    workers: Annotated[
        int, typer.Option(min=1, help="API processes (uvicorn workers); the trial worker stays one")
    ] = 1,
    no_worker: Annotated[
        bool, typer.Option("--no-worker", help="API only; run `tuner worker`s apart")
    ] = False,
) -> None:
    """The REST API and dashboard, plus one embedded trial worker (the single-machine default).
    With --workers N, N API processes share the port (uvicorn's workers; each reads the same
    TUNER_* settings); studies still run in this process's one embedded worker."""
    try:
        import uvicorn

        from api.main import create_app
    except ImportError as e:
        fail(f"tuner serve needs the API's packages: pip install 'parallel-tuner[api]' ({e})")
    from tuner.cli.common import sessions
    from tuner.worker import run_worker

    settings = ctx.obj
    sessions(settings)  # the database answers and is at the latest schema, before any process starts
    stop, thread = threading.Event(), None
    if not no_worker:
        thread = threading.Thread(target=run_worker, args=(settings,), kwargs={"stop": stop}, daemon=True,
                                  name="tuner-worker")  # fmt: skip
        thread.start()
    try:
        if workers == 1:
            uvicorn.run(create_app(settings), host=host, port=port, log_level="info", server_header=False)
        else:  # each process builds its app from the environment
            uvicorn.run("api.main:create_app", factory=True, host=host, port=port, workers=workers,
                        log_level="info", server_header=False)  # fmt: skip
    finally:
        stop.set()  # the embedded worker hands its study back (running trials re-queued)
        if thread is not None:
            thread.join(timeout=60)


def register(app: typer.Typer) -> None:
    app.command()(serve)
