"""`tuner`: the command-line interface, one module per command group. Torch-free: trials run in
their own processes. Each command module registers its commands on the app (`register(app)`) and
never imports this package, so there is no import cycle; `tuner plan` and `tuner memcheck` share
their flags through tuner/cli/options.py."""

from __future__ import annotations

import typer

from tuner.cli import common, memcheck, plan, results, study

app = typer.Typer(
    help="parallel-tuner: find the fastest way to train a GPT on a cluster.", no_args_is_help=True
)


@app.callback()
def main(ctx: typer.Context) -> None:
    """parallel-tuner command line."""
    from tuner.settings import Settings

    try:
        ctx.obj = Settings.from_env()  # read once, passed to every command; a bad TUNER_* is one line
    except ValueError as e:
        common.fail(str(e))


@app.command()
def version() -> None:
    """Print the installed version."""
    from importlib.metadata import version as dist_version

    typer.echo(dist_version("parallel-tuner"))


def _register_plugins() -> None:
    """Commands other packages of the distribution add through the `parallel_tuner.cli` entry
    point group: `tuner serve` is registered by the API package (its cli module), so this package
    never imports it."""
    from importlib.metadata import entry_points

    for ep in entry_points(group="parallel_tuner.cli"):
        ep.load()(app)


for module in (plan, study, results, memcheck):  # the order `tuner --help` lists them in
    module.register(app)
_register_plugins()
