"""`tuner run | demo | studies | trials | best | db upgrade`: the commands that use the database."""

from __future__ import annotations

import datetime as dt
import json
import signal
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from tuner import store
from tuner.db import DatabaseError, connect
from tuner.dispatch import BACKENDS, make_dispatcher
from tuner.loop import Progress as LoopProgress
from tuner.loop import run_study
from tuner.settings import Settings
from tuner.spec import SpecError, load_spec

STUDIES_DIR = Path(__file__).resolve().parent.parent / "studies"
console = Console()


def _fail(message: str) -> None:
    typer.echo(message, err=True)
    raise typer.Exit(2)


def _sessions(settings: Settings):
    try:
        return connect(settings.database_url)
    except DatabaseError as e:
        _fail(str(e))


def _run(spec_path: Path, name: str | None, settings: Settings, backend: str | None = None) -> str:
    try:
        spec = load_spec(spec_path)
    except SpecError as e:
        _fail(str(e))
    if name:
        spec = spec.model_copy(update={"name": name})
    sessions = _sessions(settings)
    with sessions.begin() as s:
        existing = store.get_study(s, spec.name)
        if existing is None:
            store.create_study(s, spec)
        elif existing.status in ("COMPLETE", "FAILED", "CANCELLED"):
            _fail(f"study {spec.name!r} already ran ({existing.status}); pick another --name")
        else:
            console.print(f"resuming study {escape(repr(spec.name))} ({existing.status})")
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
            status = _follow_allocations(sessions, spec, settings, lambda n: bar.update(task, completed=n),
                                         should_stop=lambda: stop["now"])  # fmt: skip
        else:
            status = run_study(sessions, spec.name, make_dispatcher(spec, backend), settings.work_dir,
                               on_progress=update, should_stop=lambda: stop["now"])  # fmt: skip
    with sessions() as s:
        study = store.get_study(s, spec.name)
        best = store.best_trial(s, study)
        console.print(f"study {escape(repr(spec.name))}: {status}")
        if best is None:
            console.print("no layout completed")
        else:
            cfg = store.config_of(best)
            console.print(f"best layout: [bold]{cfg.describe()}[/bold] - {best.tokens_per_s:,.0f} tokens/s, "
                          f"{best.tflops_per_device:.4f} TFLOP/s per device, MFU {best.mfu:.1%}, "
                          f"peak {best.peak_memory_bytes / 2**20:.1f} MiB (trial {best.number})")  # fmt: skip
    return status


MAX_ALLOCATIONS = 20


def _follow_allocations(sessions, spec, settings: Settings, on_finished, should_stop) -> str:
    """Allocation mode: submit an allocation that runs the study, follow it in the database, and
    submit the next one when an allocation ends with the study unfinished (handed back)."""
    from tuner.dispatch.allocation import submit_allocation
    from tuner.dispatch.slurm import ACTIVE, SiteSettings, sacct_states, squeue_states

    with sessions() as s:
        study_id = store.get_study(s, spec.name).id
    env = {"TUNER_DATABASE_URL": settings.database_url, "TUNER_WORK_DIR": str(settings.work_dir.resolve())}
    site, job, submitted = SiteSettings.from_env(), None, 0
    while True:
        with sessions() as s:
            study = s.get(store.Study, study_id)
            status = study.status
            on_finished(sum(t.state in ("COMPLETE", "FAIL") for t in study.trials))
        if status in ("COMPLETE", "FAILED", "CANCELLED"):
            return status
        if should_stop():
            with sessions.begin() as s:
                s.get(store.Study, study_id).status = "CANCELLED"  # the runner cancels its steps
            should_stop = lambda: False  # noqa: E731
        state = None
        if job is not None:
            state = (squeue_states([job]) or sacct_states([job])).get(job, ("UNKNOWN", ""))[0]
        if job is None or state not in ACTIVE:
            with sessions() as s:  # the runner may have finished the study as its job ended
                if (status := s.get(store.Study, study_id).status) in ("COMPLETE", "FAILED", "CANCELLED"):
                    return status
            if submitted >= MAX_ALLOCATIONS:
                return status
            job = submit_allocation(study_id, spec, settings.work_dir, site=site, env=env)
            submitted += 1
            console.print(f"  allocation {job} submitted ({spec.slurm.allocation_minutes} min)")
        time.sleep(2)


def register(app: typer.Typer) -> None:
    @app.command()
    def run(
        spec: Annotated[Path, typer.Argument(help="study spec (YAML)")],
        name: Annotated[str | None, typer.Option(help="study name (default: the spec's)")] = None,
        backend: Annotated[
            str | None, typer.Option(help=f"where trials run: {list(BACKENDS)} (default: the spec's)")
        ] = None,
    ) -> None:
        """Run a study in the foreground (resumes it if it was interrupted)."""
        if backend is not None and backend not in BACKENDS:
            _fail(f"--backend: {backend!r} is not one of {list(BACKENDS)}")
        status = _run(spec, name, Settings.from_env(), backend)
        raise typer.Exit(0 if status == "COMPLETE" else 1)

    @app.command(hidden=True)
    def alloc_run(
        study_id: int,
        margin_s: Annotated[
            float | None,
            typer.Option(help="hand the study back this long before the end (default: the spec's)"),
        ] = None,
    ) -> None:
        """Inside a Slurm allocation: run the study's trials as srun steps (allocation mode)."""
        from tuner.dispatch.allocation import run_in_allocation

        status = run_in_allocation(study_id, margin_s=margin_s)
        console.print(f"study {study_id}: {status}")

    @app.command()
    def demo() -> None:
        """The tiny CPU study (studies/tiny-cpu.yaml) end to end with the model sampler."""
        name = f"tiny-cpu-{dt.datetime.now():%Y%m%d-%H%M%S}"
        status = _run(STUDIES_DIR / "tiny-cpu.yaml", name, Settings.from_env())
        raise typer.Exit(0 if status == "COMPLETE" else 1)

    @app.command()
    def studies(as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
        """List studies."""
        with _sessions(Settings.from_env())() as s:
            rows = [{"name": st.name, "status": st.status, "model": st.model_key, "cluster": st.cluster_key,
                     "gpus": st.num_gpus, "sampler": st.sampler, "trials": len(st.trials),
                     "created_at": st.created_at.isoformat()} for st in store.list_studies(s)]  # fmt: skip
        if as_json:
            typer.echo(json.dumps(rows, indent=1))
            return
        table = Table("name", "status", "model", "cluster", "gpus", "sampler", "trials", "created")
        for r in rows:
            table.add_row(*(escape(str(r[k])) for k in ("name", "status", "model", "cluster", "gpus", "sampler", "trials")),
                          r["created_at"][:19])  # fmt: skip
        console.print(table)

    @app.command()
    def trials(study: str, as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
        """The trials of one study."""
        with _sessions(Settings.from_env())() as s:
            found = store.get_study(s, study)
            if found is None:
                _fail(f"no study {study!r}; see `tuner studies`")
            rows = [_trial_row(t) for t in store.trials(s, found)]
        if as_json:
            typer.echo(json.dumps(rows, indent=1))
            return
        table = Table("#", "state", "layout", "tokens/s", "TFLOP/s/dev", "MFU", "peak MiB", "predicted tokens/s",
                      "failure", "job", "job state")  # fmt: skip
        for r in rows:
            table.add_row(str(r["number"]), r["state"], r["layout"], _num(r["tokens_per_s"], ",.0f"),
                          _num(r["tflops_per_device"], ".4f"), _num(r["mfu"], ".1%"),
                          _num(r["peak_memory_bytes"] and r["peak_memory_bytes"] / 2**20, ".1f"),
                          _num(r["predicted_tokens_per_s"], ",.0f"), r["failure_kind"] or "",
                          (r["job_id"] or "").partition("@")[0], r["job_state"] or "")  # fmt: skip
        console.print(table)

    @app.command()
    def best(
        model: Annotated[str | None, typer.Option(help="model preset or shape key")] = None,
        gpus: Annotated[int | None, typer.Option(help="devices")] = None,
        cluster: Annotated[str | None, typer.Option(help="cluster name")] = None,
        as_json: Annotated[bool, typer.Option("--json")] = False,
    ) -> None:
        """The fastest measured layout per model size, cluster and device count, across studies."""
        with _sessions(Settings.from_env())() as s:
            rows = [b.to_dict() for b in store.best_configs(s, model=model, cluster=cluster, num_gpus=gpus)]
        if as_json:
            typer.echo(json.dumps(rows, indent=1))
            return
        if not rows:
            typer.echo("no completed trial matches")
            raise typer.Exit(1)
        for r in rows:
            from trainer.config import ParallelConfig

            layout = ParallelConfig.from_dict(r["config"]).describe()
            typer.echo(f"{r['model_key']} ({r['num_params'] / 1e6:,.1f}M params) on {r['num_gpus']} x {r['cluster_key']}: "
                       f"{layout} - {r['tokens_per_s']:,.0f} tokens/s, MFU {r['mfu']:.1%} (study {r['study']}, trial "
                       f"{r['trial_number']})")  # fmt: skip

    db_app = typer.Typer(help="Database maintenance.")
    app.add_typer(db_app, name="db")

    @db_app.command("upgrade")
    def db_upgrade() -> None:
        """Create or migrate the schema to the latest revision."""
        settings = Settings.from_env()
        _sessions(settings)
        typer.echo(f"database at {settings.database_url} is at the latest revision")


def _trial_row(t) -> dict[str, Any]:
    return {
        "number": t.number, "state": t.state, "layout": store.config_of(t).describe(), "config": t.config,
        "tokens_per_s": t.tokens_per_s, "tflops_per_device": t.tflops_per_device, "mfu": t.mfu,
        "peak_memory_bytes": t.peak_memory_bytes, "predicted_tokens_per_s": t.predicted_tokens_per_s,
        "predicted_memory_bytes": t.predicted_memory_bytes, "failure_kind": t.failure_kind,
        "failure_message": t.failure_message, "job_id": t.job_id, "job_state": t.job_state, "log_path": t.log_path,
        "attempts": t.attempts,
    }  # fmt: skip


def _num(value, fmt: str) -> str:
    return "" if value is None else format(value, fmt)
