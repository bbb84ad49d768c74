"""`tuner run | demo | worker | alloc-run | db upgrade | calibrate`: the commands that run studies
and look after the database. Settings come from the CLI's callback (ctx.obj), read once."""

from __future__ import annotations

import datetime as dt
import json
import signal
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from tuner import store
from tuner.cli.common import console, fail, sessions
from tuner.dispatch import BACKENDS, close_dispatcher, make_dispatcher
from tuner.loop import Progress as LoopProgress
from tuner.loop import run_study
from tuner.outcome import StudyStatus
from tuner.settings import Settings
from tuner.spec import SpecError, load_spec

STUDIES_DIR = Path(__file__).resolve().parents[2] / "studies"


def _run(spec_path: Path, name: str | None, settings: Settings, backend: str | None = None,
         takeover: bool = False) -> StudyStatus:  # fmt: skip
    try:
        spec = load_spec(spec_path)
    except SpecError as e:
        fail(str(e))
    if name:
        spec = spec.model_copy(update={"name": name})
    db = sessions(settings)
    with db.begin() as s:
        existing = store.get_study(s, spec.name)
        if existing is None:
            study_id = store.create_study(s, spec).id
        elif store.status_of(existing).is_final:
            fail(f"study {spec.name!r} already ran ({existing.status.word}); pick another --name")
        else:
            study_id = existing.id
            console.print(f"resuming study {escape(repr(spec.name))} ({existing.status.word})")
    stop = {"now": False}
    signal.signal(signal.SIGINT, lambda *_: stop.update(now=True))
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[best]}"), console=console) as bar:  # fmt: skip
        task = bar.add_task(escape(spec.name), total=spec.budget.max_trials, best="")

        def update(p: LoopProgress) -> None:
            best = f"best {p.best_tokens_per_s:,.0f} tokens/s: {p.best_layout}" if p.best_layout else ""
            bar.update(task, completed=min(p.finished, spec.budget.max_trials), best=best)
            bar.console.print(f"  {escape(p.last)}")

        if (backend or spec.backend) == "slurm" and spec.slurm.mode == "allocation":
            from tuner.worker import follow_allocations

            status = follow_allocations(db, study_id, spec, settings, on_finished=lambda n: bar.update(task, completed=n),
                                        should_stop=lambda: stop["now"], say=console.print)  # fmt: skip
        else:
            try:
                dispatcher = make_dispatcher(spec, backend, site=settings.slurm.site())
                try:
                    status = run_study(db, study_id, dispatcher, settings.work_dir,
                                       lease_s=settings.lease_s, takeover=takeover, on_progress=update,
                                       should_stop=lambda: stop["now"])  # fmt: skip
                finally:
                    close_dispatcher(dispatcher)
            except store.ClaimRefused as e:
                bar.stop()
                fail(f"{e}" + ("" if takeover else "; `tuner run --takeover` takes over an expired lease"))
    with db() as s:
        study = store.get_study(s, spec.name)
        best = store.best_trial(s, study)
        console.print(f"study {escape(repr(spec.name))}: {status.word}")
        if best is None:
            console.print("no layout completed")
        else:
            cfg = store.config_of(best)
            console.print(f"best layout: [bold]{cfg.describe()}[/bold] - {best.tokens_per_s:,.0f} tokens/s, "
                          f"{best.tflops_per_device:.4f} TFLOP/s per device, MFU {best.mfu:.1%}, "
                          f"peak {best.peak_memory_bytes / 2**20:.1f} MiB (trial {best.number})")  # fmt: skip
    return status


def run(
    ctx: typer.Context,
    spec: Annotated[Path, typer.Argument(help="study spec (YAML)")],
    name: Annotated[str | None, typer.Option(help="study name (default: the spec's)")] = None,
    backend: Annotated[
        str | None, typer.Option(help=f"where trials run: {list(BACKENDS)} (default: the spec's)")
    ] = None,
    takeover: Annotated[
        bool, typer.Option("--takeover", help="take the study over from a worker whose lease expired")
    ] = False,
) -> None:
    """Run a study in the foreground (resumes it if it was interrupted). A study another live
    worker holds is refused, naming the worker."""
    if backend is not None and backend not in BACKENDS:
        fail(f"--backend: {backend!r} is not one of {list(BACKENDS)}")
    status = _run(spec, name, ctx.obj, backend, takeover)
    raise typer.Exit(0 if status is StudyStatus.COMPLETE else 1)


def alloc_run(
    study_id: int,
    margin_s: Annotated[
        float | None, typer.Option(help="hand the study back this long before the end (default: the spec's)")
    ] = None,
) -> None:
    """Inside a Slurm allocation: run the study's trials as srun steps (allocation mode)."""
    from tuner.worker import run_in_allocation

    console.print(f"study {study_id}: {run_in_allocation(study_id, margin_s=margin_s).word}")


def demo(ctx: typer.Context) -> None:
    """The tiny Llama CPU study (studies/tiny-llama-cpu.yaml) end to end with the model sampler."""
    name = f"tiny-llama-cpu-{dt.datetime.now():%Y%m%d-%H%M%S}"
    status = _run(STUDIES_DIR / "tiny-llama-cpu.yaml", name, ctx.obj)
    raise typer.Exit(0 if status is StudyStatus.COMPLETE else 1)


def worker(
    ctx: typer.Context,
    once: Annotated[bool, typer.Option(help="run one study, then exit")] = False,
    exit_when_idle: Annotated[bool, typer.Option(help="exit when no study is pending")] = False,
    poll_s: Annotated[float, typer.Option(help="seconds between looks for pending studies")] = 2.0,
    backend: Annotated[str | None, typer.Option(help=f"{list(BACKENDS)} (default: each spec's)")] = None,
) -> None:
    """Claim pending studies (and ones whose worker's lease expired) and run them; several
    workers share one PostgreSQL database."""
    import threading

    from tuner.worker import run_worker

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    ran = run_worker(ctx.obj, once=once, exit_when_idle=exit_when_idle, poll_s=poll_s, backend=backend, stop=stop,
                     on_claim=lambda i, n: console.print(f"running study {i} {escape(repr(n))}"))  # fmt: skip
    console.print(f"worker done: {ran} studies")


def db_upgrade(ctx: typer.Context) -> None:
    """Create or migrate the schema to the latest revision."""
    sessions(ctx.obj)
    typer.echo(f"database at {ctx.obj.database_url} is at the latest revision")


def calibrate_export(
    ctx: typer.Context, path: Annotated[Path, typer.Argument(help="JSON file to write ('-': stdout)")]
) -> None:
    """Every stored calibration (the planner's priors, per cluster) as JSON, to move to another database."""
    with sessions(ctx.obj)() as s:
        rows = store.export_calibrations(s)
    text = json.dumps(rows, indent=1)
    if str(path) == "-":
        typer.echo(text)
    else:
        path.write_text(text + "\n")
        console.print(f"{len(rows)} calibrations written to {escape(str(path))}")


def calibrate_import(
    ctx: typer.Context, path: Annotated[Path, typer.Argument(help="JSON file of `calibrate export`")]
) -> None:
    """Add calibrations exported from another database; the newest per cluster is that cluster's prior."""
    try:
        rows = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        fail(f"{path}: cannot read calibrations: {e}")
    with sessions(ctx.obj).begin() as s:
        try:
            added = store.import_calibrations(s, rows)
        except ValueError as e:
            fail(f"{path}: {e}")
    console.print(f"{added} calibrations imported")


def register(app: typer.Typer) -> None:
    for command in (run, demo, worker):
        app.command()(command)
    app.command(hidden=True, name="alloc-run")(alloc_run)
    db_app = typer.Typer(help="Database maintenance.")
    db_app.command("upgrade")(db_upgrade)
    app.add_typer(db_app, name="db")
    cal_app = typer.Typer(help="The performance model's calibrations (each cluster's prior).")
    cal_app.command("export")(calibrate_export)
    cal_app.command("import")(calibrate_import)
    app.add_typer(cal_app, name="calibrate")
