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
from tuner.outcome import StudyStatus
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


def _run(spec_path: Path, name: str | None, settings: Settings, backend: str | None = None,
         takeover: bool = False) -> StudyStatus:  # fmt: skip
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
            study_id = store.create_study(s, spec).id
        elif store.status_of(existing).is_final:
            _fail(f"study {spec.name!r} already ran ({existing.status}); pick another --name")
        else:
            study_id = existing.id
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
            from tuner.worker import follow_allocations

            status = follow_allocations(sessions, study_id, spec, settings, on_finished=lambda n: bar.update(task, completed=n),
                                        should_stop=lambda: stop["now"], say=console.print)  # fmt: skip
        else:
            try:
                status = run_study(sessions, study_id, make_dispatcher(spec, backend), settings.work_dir,
                                   lease_s=settings.lease_s, takeover=takeover, on_progress=update,
                                   should_stop=lambda: stop["now"])  # fmt: skip
            except store.ClaimRefused as e:
                bar.stop()
                _fail(f"{e}" + ("" if takeover else "; `tuner run --takeover` takes over an expired lease"))
    with sessions() as s:
        study = store.get_study(s, spec.name)
        best = store.best_trial(s, study)
        console.print(f"study {escape(repr(spec.name))}: {status.value}")
        if best is None:
            console.print("no layout completed")
        else:
            cfg = store.config_of(best)
            console.print(f"best layout: [bold]{cfg.describe()}[/bold] - {best.tokens_per_s:,.0f} tokens/s, "
                          f"{best.tflops_per_device:.4f} TFLOP/s per device, MFU {best.mfu:.1%}, "
                          f"peak {best.peak_memory_bytes / 2**20:.1f} MiB (trial {best.number})")  # fmt: skip
    return status


Url = Annotated[
    str | None,
    typer.Option("--url", envvar="TUNER_URL", help="a `tuner serve` API; default: the database"),
]
Token = Annotated[
    str | None,
    typer.Option("--token", envvar="TUNER_API_TOKEN", help="bearer token for --url", show_default=False),
]
Json = Annotated[bool, typer.Option("--json", help="print JSON")]


def register(app: typer.Typer) -> None:
    @app.command()
    def run(
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
            _fail(f"--backend: {backend!r} is not one of {list(BACKENDS)}")
        status = _run(spec, name, Settings.from_env(), backend, takeover)
        raise typer.Exit(0 if status is StudyStatus.COMPLETE else 1)

    @app.command(hidden=True)
    def alloc_run(
        study_id: int,
        margin_s: Annotated[
            float | None,
            typer.Option(help="hand the study back this long before the end (default: the spec's)"),
        ] = None,
    ) -> None:
        """Inside a Slurm allocation: run the study's trials as srun steps (allocation mode)."""
        from tuner.worker import run_in_allocation

        status = run_in_allocation(study_id, margin_s=margin_s)
        console.print(f"study {study_id}: {status.value}")

    @app.command()
    def demo() -> None:
        """The tiny CPU study (studies/tiny-cpu.yaml) end to end with the model sampler."""
        name = f"tiny-cpu-{dt.datetime.now():%Y%m%d-%H%M%S}"
        status = _run(STUDIES_DIR / "tiny-cpu.yaml", name, Settings.from_env())
        raise typer.Exit(0 if status is StudyStatus.COMPLETE else 1)

    @app.command()
    def studies(url: Url = None, token: Token = None, as_json: Json = False) -> None:
        """List studies."""
        if url:
            rows = [{"id": r["id"], "name": r["name"], "status": r["status"], "model": r["model"], "cluster": r["cluster"],
                     "gpus": r["gpus"], "sampler": r["sampler"], "trials": sum(r["progress"]["by_state"].values()),
                     "created_at": r["created_at"], "owner": r.get("owner"), "lease": r.get("lease"),
                     "reason": r.get("reason")} for r in _client(url, token).studies()]  # fmt: skip
        else:
            with _sessions(Settings.from_env())() as s:
                found = store.list_studies(s)
                counts = store.trial_counts(s, [st.id for st in found])
                rows = [{"id": st.id, "name": st.name, "status": store.status_of(st).word, "model": st.model_key,
                         "cluster": st.cluster_key, "gpus": st.num_gpus, "sampler": st.sampler,
                         "trials": sum(counts[st.id].values()), "created_at": st.created_at.isoformat(),
                         "owner": st.lease_owner, "lease": store.describe_lease(st) if st.lease_expires_at else None,
                         "reason": st.error}
                        for st in found]  # fmt: skip
        if as_json:
            typer.echo(json.dumps(rows, indent=1))
            return
        table = Table(
            "id", "name", "status", "model", "cluster", "gpus", "sampler", "trials", "created", "held by"
        )
        for r in rows:
            held = r["lease"] or (f"(last: {r['owner']})" if r["owner"] else "")
            table.add_row(*(escape(str(r[k])) for k in ("id", "name", "status", "model", "cluster", "gpus", "sampler",
                                                        "trials")), r["created_at"][:19], escape(held))  # fmt: skip
        console.print(table)

    @app.command()
    def trials(
        study: Annotated[str, typer.Argument(help="study id or name (id only with --url)")],
        url: Url = None, token: Token = None, as_json: Json = False,
        csv: Annotated[bool, typer.Option("--csv", help="every trial as one flat CSV table")] = False,
    ) -> None:  # fmt: skip
        """The trials of one study."""
        if url:
            client = _client(url, token)
            study_id = _study_id(study)
            if csv:
                typer.echo(_call(lambda: client.trials_csv(study_id)), nl=False)
                return
            rows = _call(lambda: client.trials(study_id))
        else:
            with _sessions(Settings.from_env())() as s:
                found = store.get_study(s, study)
                if found is None:
                    _fail(f"no study {study!r}; see `tuner studies`")
                if csv:
                    from api.frames import trials_frame

                    typer.echo(trials_frame(store.trials(s, found)).to_csv(index=False), nl=False)
                    return
                rows = [_trial_row(t) for t in store.trials(s, found)]
        if as_json:
            typer.echo(json.dumps(rows, indent=1, default=str))
            return
        table = Table("#", "state", "layout", "tokens/s", "TFLOP/s/dev", "MFU", "peak MiB", "predicted tokens/s",
                      "failure", "job", "job state")  # fmt: skip
        for r in rows:
            table.add_row(str(r["number"]), r["state"], r["layout"], _num(r["tokens_per_s"], ",.0f"),
                          _num(r["tflops_per_device"], ".4f"), _num(r["mfu"], ".1%"),
                          _num(r["peak_memory_bytes"] and r["peak_memory_bytes"] / 2**20, ".1f"),
                          _num(r["predicted_tokens_per_s"], ",.0f"), r["failure_kind"] or "",
                          (r["job_id"] or "").partition("@")[0].partition(":")[2], r["job_state"] or "")  # fmt: skip
        console.print(table)

    @app.command()
    def best(
        model: Annotated[str | None, typer.Option(help="model preset or shape key")] = None,
        gpus: Annotated[int | None, typer.Option(help="devices")] = None,
        cluster: Annotated[str | None, typer.Option(help="cluster name")] = None,
        url: Url = None, token: Token = None, as_json: Json = False,
    ) -> None:  # fmt: skip
        """The fastest measured layout per model size, cluster and device count, across studies."""
        if url:
            rows = _call(lambda: _client(url, token).best(model=model, gpus=gpus, cluster=cluster))
        else:
            with _sessions(Settings.from_env())() as s:
                rows = store.best_rows(s, model=model, cluster=cluster, num_gpus=gpus)
        if as_json:
            typer.echo(json.dumps(rows, indent=1))
            return
        if not rows:
            typer.echo("no completed trial matches")
            raise typer.Exit(1)
        for r in rows:
            mfu = f"MFU {r['mfu']:.1%}" if r["mfu"] is not None else "MFU -"
            typer.echo(f"{r['model']} ({r['num_params'] / 1e6:,.1f}M params) on {r['gpus']} x {r['cluster']}: "
                       f"{r['layout']} - {r['tokens_per_s']:,.0f} tokens/s, {mfu} (study {r['study_id']} "
                       f"{r['study']!r}, trial {r['trial_number']})")  # fmt: skip

    @app.command()
    def submit(
        spec: Annotated[Path, typer.Argument(help="study spec (YAML)")],
        url: Url = None, token: Token = None,
        wait: Annotated[bool, typer.Option("--wait", help="follow the study to its end with a progress bar")] = False,
        as_json: Json = False,
    ) -> None:  # fmt: skip
        """Submit a study for a worker to run: to a server (--url), or straight into the database."""
        try:
            text = spec.read_text()
            parsed = load_spec(spec)
        except SpecError as e:
            _fail(str(e))
        except OSError as e:
            _fail(f"{spec}: cannot read: {e.strerror}")
        if url:
            client = _client(url, token)
            created = _call(lambda: client.submit(text))
            study_id = created["id"]
        else:
            with _sessions(Settings.from_env()).begin() as s:
                try:
                    study_id = store.create_study(s, parsed).id
                except store.StudyExists as e:
                    _fail(str(e))
        if as_json and not wait:
            typer.echo(json.dumps({"id": study_id, "name": parsed.name}))
            return
        console.print(f"study {study_id} {escape(repr(parsed.name))} submitted")
        if wait:
            status = _wait_for(study_id, url, token, parsed.budget.max_trials)
            raise typer.Exit(0 if status == "done" else 1)

    @app.command()
    def cancel(
        study: Annotated[str, typer.Argument(help="study id (or name without --url)")],
        url: Url = None,
        token: Token = None,
    ) -> None:
        """Cancel a pending or running study."""
        if url:
            _call(lambda: _client(url, token).cancel(_study_id(study)))
        else:
            with _sessions(Settings.from_env()).begin() as s:
                found = store.get_study(s, study)
                if found is None:
                    _fail(f"no study {study!r}; see `tuner studies`")
                result = store.cancel(s, found.id, "cancelled from the CLI")
            console.print(escape(result.message))
            return
        console.print(f"study {escape(study)} cancelled")

    @app.command()
    def export(
        study: Annotated[str, typer.Argument(help="study id (or name without --url)")],
        fmt: Annotated[str, typer.Option("--format", help="torchtitan | megatron | sbatch")] = "torchtitan",
        url: Url = None, token: Token = None,
    ) -> None:  # fmt: skip
        """The study's best layout as a ready launch config."""
        from tuner.export import FORMATS, export_layout

        if fmt not in FORMATS:
            _fail(f"--format: {fmt!r} is not one of {list(FORMATS)}")
        if url:
            typer.echo(_call(lambda: _client(url, token).export(_study_id(study), fmt)), nl=False)
            return
        with _sessions(Settings.from_env())() as s:
            found = store.get_study(s, study)
            if found is None:
                _fail(f"no study {study!r}; see `tuner studies`")
            best_trial = store.best_trial(s, found)
            if best_trial is None:
                _fail(f"study {study!r} has no completed trial yet")
            from tuner.spec import StudySpec

            typer.echo(
                export_layout(fmt, StudySpec.model_validate(found.spec), store.config_of(best_trial)),
                nl=False,
            )

    @app.command()
    def worker(
        once: Annotated[bool, typer.Option(help="run one study, then exit")] = False,
        exit_when_idle: Annotated[bool, typer.Option(help="exit when no study is pending")] = False,
        poll_s: Annotated[float, typer.Option(help="seconds between looks for pending studies")] = 2.0,
        backend: Annotated[str | None, typer.Option(help=f"{list(BACKENDS)} (default: each spec's)")] = None,
    ) -> None:
        """Claim pending studies from the database and run them (several workers: PostgreSQL)."""
        import threading

        from tuner.worker import run_worker

        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        ran = run_worker(Settings.from_env(), once=once, exit_when_idle=exit_when_idle, poll_s=poll_s,
                         backend=backend, stop=stop,
                         on_claim=lambda i, n: console.print(f"running study {i} {escape(repr(n))}"))  # fmt: skip
        console.print(f"worker done: {ran} studies")

    @app.command()
    def serve(
        host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
        port: Annotated[int, typer.Option(help="port")] = 8000,
        no_worker: Annotated[
            bool, typer.Option("--no-worker", help="API only; run `tuner worker`s apart")
        ] = False,
    ) -> None:
        """The REST API and dashboard, plus one embedded worker (the single-machine default)."""
        import threading

        import uvicorn

        from api.app import create_app
        from tuner.worker import run_worker

        settings = Settings.from_env()
        app_ = create_app(settings, _sessions(settings))
        stop = threading.Event()
        thread = None
        if not no_worker:
            thread = threading.Thread(target=run_worker, args=(settings,), kwargs={"stop": stop}, daemon=True,
                                      name="tuner-worker")  # fmt: skip
            thread.start()
        try:
            uvicorn.run(app_, host=host, port=port, log_level="info", server_header=False)
        finally:
            stop.set()  # the worker hands its study back (running trials re-queued)
            if thread is not None:
                thread.join(timeout=60)

    db_app = typer.Typer(help="Database maintenance.")
    app.add_typer(db_app, name="db")

    @db_app.command("upgrade")
    def db_upgrade() -> None:
        """Create or migrate the schema to the latest revision."""
        settings = Settings.from_env()
        _sessions(settings)
        typer.echo(f"database at {settings.database_url} is at the latest revision")


def _client(url: str, token: str | None):
    from tuner.client import Client

    return Client(url, token)


def _call(fn):
    from tuner.client import ClientError

    try:
        return fn()
    except ClientError as e:
        _fail(str(e))


def _study_id(study: str) -> int:
    if not study.isdigit():
        _fail(f"with --url, name the study by its id (see `tuner studies --url ...`), not {study!r}")
    return int(study)


def _wait_for(study_id: int, url: str | None, token: str | None, budget: int) -> str:
    """Follow a study with a progress bar until it ends; returns its status word."""
    with Progress(TextColumn("study {task.fields[sid]}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[best]}"), console=console) as bar:  # fmt: skip
        task = bar.add_task("", total=budget, sid=study_id, best="")
        while True:
            if url:
                d = _call(lambda: _client(url, token).study(study_id))
                status, done, best = d["status"], d["progress"]["finished"], d["best_tokens_per_s"]
            else:
                with _sessions(Settings.from_env())() as s:
                    st = s.get(store.Study, study_id)
                    counts = store.trial_counts(s, [study_id])[study_id]
                    status = store.status_of(st).word
                    done = sum(n for k, n in counts.items() if k in ("COMPLETE", "FAIL", "PRUNED"))
                    b = store.best_trial(s, st)
                    best = b.tokens_per_s if b else None
            bar.update(task, completed=min(done, budget), best=f"best {best:,.0f} tokens/s" if best else "")
            if status in ("done", "failed", "cancelled"):  # final words (tuner/outcome.py)
                break
            time.sleep(1.0)
    console.print(f"study {study_id}: {status}")
    return status


def _trial_row(t) -> dict[str, Any]:
    return {
        "number": t.number, "state": t.state, "layout": store.config_of(t).describe(), "config": t.config,
        "tokens_per_s": t.tokens_per_s, "tflops_per_device": t.tflops_per_device, "mfu": t.mfu,
        "peak_memory_bytes": t.peak_memory_bytes, "predicted_tokens_per_s": t.predicted_tokens_per_s,
        "predicted_memory_bytes": t.predicted_memory_bytes, "failure_kind": t.failure_kind,
        "failure_message": t.failure_message, "job_id": t.job_id, "job_state": t.job_state, "log_path": t.log_path,
        "attempts": t.attempts, "attempt_log": t.attempt_log, "device_s": t.device_s, "told": t.told,
    }  # fmt: skip


def _num(value, fmt: str) -> str:
    return "" if value is None else format(value, fmt)
