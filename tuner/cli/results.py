"""`tuner studies | trials | best | submit | cancel | export`: read and write studies through one
backend (tuner/backend.py): the database, or a server with --url. Same rows either way."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer
import yaml
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from tuner.backend import Backend, BackendError, DatabaseBackend, HttpBackend
from tuner.cli.common import console, fail, sessions
from tuner.models import model_label
from tuner.outcome import StudyStatus
from tuner.payoff import describe as describe_payoff
from tuner.spec import SpecError, parse_spec, read_spec_file

Url = Annotated[
    str | None, typer.Option("--url", envvar="TUNER_URL", help="a `tuner serve` API; default: the database")
]
Token = Annotated[
    str | None,
    typer.Option("--token", envvar="TUNER_API_TOKEN", help="bearer token for --url", show_default=False),
]
Json = Annotated[bool, typer.Option("--json", help="print JSON (the API's shapes)")]
StudyRef = Annotated[str, typer.Argument(help="study id (or name without --url)")]


def backend(ctx: typer.Context, url: str | None, token: str | None) -> Backend:
    return HttpBackend(url, token) if url else DatabaseBackend(sessions(ctx.obj), ctx.obj.slurm)


def _echo_json(rows) -> None:
    rows = (
        [r.model_dump(mode="json") for r in rows] if isinstance(rows, list) else rows.model_dump(mode="json")
    )
    typer.echo(json.dumps(rows, indent=1))


def _num(value, fmt: str) -> str:
    return "" if value is None else format(value, fmt)


def _held(r) -> str:
    if r.lease is not None:
        state = f"expires in {r.lease.expires_in_s:.0f} s" if r.lease.expires_in_s >= 0 else "expired"
        return f"{r.lease.owner} (renewed {r.lease.renewed_s_ago or 0:.0f} s ago, {state})"
    return f"(last: {r.owner})" if r.owner else ""


def studies(ctx: typer.Context, url: Url = None, token: Token = None, as_json: Json = False) -> None:
    """List studies, newest first, with who holds each and why it is in its state."""
    try:
        rows = backend(ctx, url, token).studies()
    except BackendError as e:
        fail(str(e))
    if as_json:
        return _echo_json(rows)
    table = Table("id", "name", "status", "model", "cluster", "gpus", "sampler", "trials", "best tokens/s",
                  "tuning device-h", "vs first guess", "created", "held by", "reason")  # fmt: skip
    for r in rows:
        guess = next((b for b in r.payoff.baselines if b.name == "first_guess"), None) if r.payoff else None
        table.add_row(str(r.id), escape(r.name), r.status.word, escape(model_label(r.model)), escape(r.cluster), str(r.gpus), r.sampler,
                      f"{r.progress.finished}/{r.progress.budget}", _num(r.best_tokens_per_s, ",.0f"),
                      _num(r.payoff and r.payoff.tuning_device_hours, ".3g"), f"{guess.speedup:.2f}x" if guess else "",
                      r.created_at.isoformat()[:19], escape(_held(r)), escape(r.reason or ""))  # fmt: skip
    console.print(table)


def trials(
    ctx: typer.Context, study: StudyRef, url: Url = None, token: Token = None, as_json: Json = False,
    csv: Annotated[bool, typer.Option("--csv", help="every trial as one flat CSV table")] = False,
) -> None:  # fmt: skip
    """The trials of one study."""
    try:
        b = backend(ctx, url, token)
        if csv:
            return typer.echo(b.trials_csv(study), nl=False)
        rows = b.trials(study)
    except BackendError as e:
        fail(str(e))
    if as_json:
        return _echo_json(rows)
    table = Table("#", "state", "layout", "tokens/s", "TFLOP/s/dev", "MFU", "peak MiB", "predicted tokens/s",
                  "failure", "attempts", "job", "job state")  # fmt: skip
    for r in rows:
        job = (r.job_id or "").partition("@")[0].partition(":")[2]
        table.add_row(str(r.number), r.state.word, r.layout, _num(r.tokens_per_s, ",.0f"), _num(r.tflops_per_device, ".4f"),
                      _num(r.mfu, ".1%"), _num(r.peak_memory_bytes and r.peak_memory_bytes / 2**20, ".1f"),
                      _num(r.predicted_tokens_per_s, ",.0f"), r.failure_kind or "", str(r.attempts), job,
                      r.job_state or "")  # fmt: skip
    console.print(table)


def best(
    ctx: typer.Context,
    model: Annotated[str | None, typer.Option(help="model preset or shape key")] = None,
    gpus: Annotated[int | None, typer.Option(help="devices")] = None,
    cluster: Annotated[str | None, typer.Option(help="cluster name")] = None,
    global_batch: Annotated[int | None, typer.Option(help="global batch of a prediction")] = None,
    write_study: Annotated[
        Path | None, typer.Option(help="for a prediction: write the short study that confirms it")
    ] = None,
    url: Url = None, token: Token = None, as_json: Json = False,
) -> None:  # fmt: skip
    """The fastest measured layout per model size, cluster and device count, across studies. For a
    model preset nobody measured yet, the planner's prediction on each calibrated cluster, marked
    PREDICTED, with the calibration it used and a command that confirms it."""
    try:
        rows = backend(ctx, url, token).best(
            model=model, gpus=gpus, cluster=cluster, global_batch=global_batch
        )
    except BackendError as e:
        fail(str(e))
    if write_study is not None:
        predicted = [r for r in rows if r.kind == "predicted"]
        if len(predicted) != 1:
            fail(
                f"--write-study needs exactly one prediction (got {len(predicted)}); name the --model and --cluster"
            )
        write_study.write_text(yaml.safe_dump(predicted[0].study_spec, sort_keys=False))
        console.print(
            f"wrote {escape(str(write_study))}: `tuner run {escape(str(write_study))}` confirms the prediction"
        )
    if as_json:
        return _echo_json(rows)
    if not rows:
        typer.echo(
            "no completed trial matches" + ("" if not model else " (and no calibrated cluster to predict on)")
        )
        raise typer.Exit(1)
    for r in rows:
        if r.kind == "predicted":
            c = r.calibration
            typer.echo(f"PREDICTED (not measured) {model_label(r.model)} ({r.num_params / 1e6:,.1f}M params) on {r.gpus} x {r.cluster}: "
                       f"{r.layout} - {r.predicted_tokens_per_s:,.0f} tokens/s, MFU {r.predicted_mfu:.1%}, "
                       f"{r.predicted_memory_bytes / 2**30:.1f} GiB (vocab padded to {r.vocab_size})")  # fmt: skip
            typer.echo(f"  calibration of {c.cluster}: {c.num_points} measurements (study {c.study_id}), rms log "
                       f"error {c.rms_log_error:.2f}; settings of study {r.template_study!r}")  # fmt: skip
            typer.echo(f"  confirm: {r.confirm}")
            continue
        mfu = f"MFU {r.mfu:.1%}" if r.mfu is not None else "MFU -"
        typer.echo(f"{model_label(r.model)} ({r.num_params / 1e6:,.1f}M params) on {r.gpus} x {r.cluster}: {r.layout} - "
                   f"{r.tokens_per_s:,.0f} tokens/s, {mfu} (study {r.study_id} {r.study!r}, trial {r.trial_number})")  # fmt: skip
        if r.payoff is not None:
            typer.echo(f"  {describe_payoff(r.payoff)}")


def submit(
    ctx: typer.Context, spec: Annotated[Path, typer.Argument(help="study spec (YAML)")], url: Url = None,
    token: Token = None,
    wait: Annotated[bool, typer.Option("--wait", help="follow the study to its end with a progress bar")] = False,
    as_json: Json = False,
) -> None:  # fmt: skip
    """Submit a study for a worker to run: to a server (--url), or straight into the database."""
    try:
        data = read_spec_file(spec)
        parsed = parse_spec(data, str(spec))
    except SpecError as e:
        fail(str(e))
    # The spec as read here, its model's hf_config replaced by the fields: a server reads no files.
    text = yaml.safe_dump(data, sort_keys=False)
    b = backend(ctx, url, token)
    try:
        created = b.submit(text, parsed)
    except BackendError as e:
        fail(str(e))
    if as_json and not wait:
        return typer.echo(json.dumps({"id": created.id, "name": created.name}))
    console.print(f"study {created.id} {escape(repr(created.name))} submitted")
    if wait:
        status = _wait_for(b, str(created.id), parsed.budget.max_trials)
        raise typer.Exit(0 if status is StudyStatus.COMPLETE else 1)


def cancel(ctx: typer.Context, study: StudyRef, url: Url = None, token: Token = None) -> None:
    """Cancel a pending or running study (a running one is `cancelling` until its worker stopped
    its trials). Cancelling a cancelled or finished study changes nothing and says so."""
    try:
        console.print(escape(backend(ctx, url, token).cancel(study)))
    except BackendError as e:
        fail(str(e))


def export(
    ctx: typer.Context, study: StudyRef,
    fmt: Annotated[str, typer.Option("--format", help="torchtitan | megatron | sbatch (what each writes: above)")] = "torchtitan",
    url: Url = None, token: Token = None,
) -> None:  # fmt: skip
    """The study's best layout as a launch config, on stdout.

    torchtitan: a Python config module for torchtitan 0.3.0 (not TOML): run it with `torchrun ... -m torchtitan.train --module FILE --config tuned_layout`; add the dataset, tokenizer, optimizer and step counts.

    megatron: a `torchrun ... pretrain_gpt.py` command with the layout's and the model's flags (megatron-core 0.19.2); add the data, tokenizer, optimizer and iteration arguments.

    sbatch: a Slurm script that runs our own trainer's short benchmark of the layout (the trial again, not a training run).

    Each file says in comments what the framework runs differently from what was measured; a layout it cannot run is refused with the reason. For a layout never trialled: `tuner plan ... --export FORMAT`."""
    from tuner.exports import FORMATS

    if fmt not in FORMATS:
        fail(f"--format: {fmt!r} is not one of {list(FORMATS)}")
    try:
        typer.echo(backend(ctx, url, token).export(study, fmt), nl=False)
    except BackendError as e:
        fail(str(e))


def _wait_for(b: Backend, ref: str, budget: int) -> StudyStatus:
    """Follow a study with a progress bar until it ends; returns its status."""
    with Progress(TextColumn("study {task.fields[sid]}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[best]}"), console=console) as bar:  # fmt: skip
        task = bar.add_task("", total=budget, sid=ref, best="")
        while True:
            try:
                d = b.study(ref)
            except BackendError as e:
                fail(str(e))
            best = f"best {d.best_tokens_per_s:,.0f} tokens/s" if d.best_tokens_per_s else ""
            bar.update(task, completed=min(d.progress.finished, budget), best=best)
            if d.status.is_final:
                break
            time.sleep(1.0)
    console.print(f"study {ref}: {d.status.word}")
    return d.status


def register(app: typer.Typer) -> None:
    for command in (studies, trials, best, submit, cancel, export):
        app.command()(command)
