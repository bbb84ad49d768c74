"""`tuner plan`: rank a study's layouts by the performance model, without running any."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from trainer.contract.axes import AXIS
from trainer.contract.parallel import ParallelConfig
from tuner.cli.common import fail, stored_constants
from tuner.cli.options import SpecOptions, spec_data, with_spec_options
from tuner.models import model_key, model_label
from tuner.plan import PlanError, layout_row, parse_pins
from tuner.plan import plan as run_plan
from tuner.space import layout
from tuner.spec import SpecError, StudySpec, parse_spec


@with_spec_options
def plan(
    opts: SpecOptions,
    top: Annotated[int, typer.Option(min=1, help="how many layouts to list")] = 10,
    include_unfit: Annotated[
        bool, typer.Option(help="also list layouts predicted to run out of memory")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print the plan as JSON")] = False,
    explain: Annotated[
        bool,
        typer.Option("--explain", help="each listed layout's predicted step, term by term (they add up)"),
    ] = False,
    verify_memory: Annotated[
        bool,
        typer.Option("--verify-memory", help="check each listed layout with the memory oracle (needs torch)"),
    ] = False,
    export: Annotated[
        str | None,
        typer.Option(
            "--export",
            help="torchtitan | megatron | sbatch: rank only the layouts that format can express and write "
            "the fastest fitting one's launch config (to stdout, or --output)",
        ),
    ] = None,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="with --export: write the launch config here")
    ] = None,
) -> None:
    """Rank every valid layout by the performance model, without running any."""
    if output is not None and export is None:
        fail("--output: needs --export FORMAT (torchtitan | megatron | sbatch)")
    try:
        study = parse_spec(spec_data(opts), str(opts.spec) if opts.spec else "plan")
        constants = stored_constants(study.cluster.name)
        result = run_plan(
            study, pins=parse_pins(opts.config), top=top, include_unfit=include_unfit, constants=constants,
            export=export, site=_site() if export == "sbatch" else None,
        )  # fmt: skip
        if verify_memory:
            from tuner.cli.memcheck import verify_candidates

            verify_candidates(study, result, constants)
    except (SpecError, PlanError, ValueError) as e:
        fail(str(e))
    exported = result.get("export")
    if output is not None and exported["text"] is not None:
        output.write_text(exported["text"])
    if as_json:
        typer.echo(json.dumps(result, indent=1))
    else:
        _print_plan(study, result)
        if explain:
            _print_terms(result)
        if verify_memory:
            from tuner.cli.memcheck import print_verified

            print_verified(result)
        if exported is not None:
            _print_export(exported, output)
    if exported is not None and exported["text"] is None:
        raise typer.Exit(1)


def _site() -> Any:
    """An sbatch export's Slurm settings (TUNER_SLURM_*), as `tuner export` writes them."""
    from tuner.exports import export_site
    from tuner.settings import Settings

    return export_site(Settings.from_env().slurm)


def _print_export(exported: dict[str, Any], output: Path | None) -> None:
    """What --export wrote: the layout, the file (or where it went), and what the format refused."""
    fmt = exported["format"]
    refused = sum(exported["refused"].values())
    if refused:
        typer.echo(f"\n{fmt} cannot express {refused} of the valid layouts (ranked without them), by reason:")
        reasons = list(exported["refused"].items())
        for reason, count in reasons[:10]:
            typer.echo(f"{count:>7}  {reason}")
        if len(reasons) > 10:
            typer.echo(
                f"{sum(n for _, n in reasons[10:]):>7}  {len(reasons) - 10} other reasons (--json lists all)"
            )
    if exported["text"] is None:
        typer.echo(f"\nno {fmt} launch config: {exported['why']}", err=True)
        return
    head = (
        f"\n{fmt} launch config for {exported['layout']} ({exported['tokens_per_s']:,.0f} tokens/s predicted)"
    )
    if output is not None:
        typer.echo(f"{head}: written to {output}")
    else:
        typer.echo(f"{head}:\n")
        typer.echo(exported["text"], nl=False)


def _print_plan(study: StudySpec, result: dict[str, Any]) -> None:
    m, c = study.as_model_config(), study.cluster
    typer.echo(f"{model_label(model_key(m, study.model.preset))}: {m.num_params / 1e9:.2f}B parameters, seq {m.seq_len}, global "
               f"batch {study.training.global_batch_size}, {study.devices} x {c.name} devices "
               f"({c.peak_tflops:g} TFLOP/s, {c.device_memory_gb:g} GB)")  # fmt: skip
    vocab = result["vocab"]
    padded = ", ".join(f"{v} at tp {t}" for t, v in vocab["padded_by_tp"].items())
    typer.echo(f"vocabulary {vocab['vocab_size']}, padded to a multiple of {vocab['divisible_by']} x tp "
               f"(Megatron-LM): {padded or '-'}")  # fmt: skip
    typer.echo(
        f"space {result['space_size']}, valid {result['num_valid']}, predicted to fit {result['num_fit']}\n"
    )
    rows = [cand["config"] for cand in result["candidates"]]
    columns = layout_columns(rows)
    cells = [[_cell(key, k) for key in columns] for k in rows]
    widths = [max([len(_heading(key)), *(len(row[i]) for row in cells)]) for i, key in enumerate(columns)]
    layout_head = " ".join(f"{_heading(key):>{w}}" for key, w in zip(columns, widths, strict=True))
    typer.echo(f"{layout_head} {'vocab':>7} {'mem GiB':>8} {'TFLOP/s':>8} {'MFU':>6} {'tokens/s':>11}")
    for cand, row in zip(result["candidates"], cells, strict=True):
        p = cand["predicted"]
        flag = "" if p["fits"] else "  (does not fit)"
        typer.echo(
            " ".join(f"{cell:>{w}}" for cell, w in zip(row, widths, strict=True))
            + f" {cand['vocab_size']:>7} {p['memory_bytes'] / 2**30:>8.1f} {p['tflops_per_device']:>8.1f} {p['mfu']:>6.1%} "
            f"{p['tokens_per_s']:>11.0f}{flag}"
        )
    if result["candidates"] and result["candidates"][0].get("experts"):
        typer.echo(f"\nthe fastest layout's {result['candidates'][0]['experts']}")
    for line in result.get("hint", []):
        typer.echo(f"\n{line}" if line is result["hint"][0] else line)
    if result.get("column"):
        typer.echo("\n2D tensor parallelism (tp x tp_col), the fastest layout of each column degree:")
        for entry in result["column"]:
            typer.echo(f"  tp_col {entry['tp_col']}: {entry['layout'] or '-'}: {entry['why']}")
    if result["rejected"]:
        typer.echo("\nrejected layouts by reason:")
        for reason, count in result["rejected"].items():
            typer.echo(f"{count:>7}  {reason}")


def _print_terms(result: dict[str, Any]) -> None:
    """Each candidate's step time as the sum of its terms (tuner.cost.terms.StepTerms), largest
    first; terms under 0.05 % of the step are folded into one line so the sum still holds. Then
    the communication hidden behind compute (Estimate.hidden), which the terms do not count."""
    from tuner.cost.terms import TERM_LABELS

    typer.echo("\nwhere each step goes (seconds; the terms add up to the step):")
    for rank, cand in enumerate(result["candidates"], 1):
        p = cand["predicted"]
        step, terms = p["step_time_s"], sorted(p["terms"].items(), key=lambda kv: -kv[1])
        shown = [(k, v) for k, v in terms if v >= 5e-4 * step]
        rest = sum(v for k, v in terms if v < 5e-4 * step)
        parts = [f"{TERM_LABELS[k]} {v:.4g} ({v / step:.0%})" for k, v in shown]
        if rest > 0:
            parts.append(f"other terms {rest:.2g}")
        typer.echo(
            f"{rank:>3}. {layout(**cand['config']).describe()}: step {step:.4g} s = " + " + ".join(parts)
        )
        hidden = [(k, v) for k, v in p.get("hidden", {}).items() if v >= 5e-4 * step]
        if hidden:
            typer.echo(
                "     hidden behind compute (not in the step): "
                + ", ".join(f"{TERM_LABELS[k]} {v:.4g}" for k, v in sorted(hidden, key=lambda kv: -kv[1]))
            )
        if cand.get("experts"):
            typer.echo(f"     {cand['experts']}")


# Axes the table shows inside another axis's column: tp x tp_col as "2x2", the schedule with its
# virtual stages as "interleaved_1f1b/v2", the ZeRO stage (and HSDP's replicas) in dp's, as
# ParallelConfig.describe and the exports' headers write them: "dps64(z3)", "dpr2 dps32(z3)".
_FOLDED = {"tp_col": "tp", "virtual_stages": "pp_schedule", "zero_stage": "dp", "dp_replicate": "dp"}


def layout_columns(rows: list[dict[str, Any]]) -> list[str]:
    """The table's layout columns: the keys of the plan's rows (tuner/plan.py layout_row: every
    axis of trainer/contract/axes.py in its order, dp whole; ep and cp where searched or used), but
    those folded into another's column; the world's axes first (dp among them), then the other
    degrees (the samplers' other integer knobs: ep), then the rest."""
    every = layout_row(ParallelConfig(), searched=AXIS)  # every key a row may have, in order
    present = {key for row in rows for key in row} or set(layout_row(ParallelConfig()))

    def group(key: str) -> int:
        a = AXIS.get(key)
        return 0 if a is None or a.multiplies_world else 1 if a.sampler == "int" else 2  # None: dp

    return sorted((key for key in every if key in present and key not in _FOLDED), key=group)


def _heading(key: str) -> str:
    return AXIS[key].heading if key in AXIS else key  # dp: dp_replicate x dp_shard


def _cell(key: str, k: dict[str, Any]) -> str:
    if key == "dp":
        return _dp_cell(k)
    value = k.get(key, AXIS[key].default if key in AXIS else None)
    if key == "tp" and k.get("tp_col", 1) > 1:
        return f"{value}x{k['tp_col']}"  # row x column
    if key == "pp_schedule":
        if k["pp"] == 1:
            return "-"  # no schedule to choose
        return value + (f"/v{k['virtual_stages']}" if k["virtual_stages"] > 1 else "")
    if isinstance(value, bool):
        return "y" if value else "n"
    return str(value)


def _dp_cell(k: dict[str, Any]) -> str:
    """Data parallelism as the layout's label writes it (trainer/contract/axes.py tokens):
    replicated "dpr8", sharded "dps64(z3)", HSDP "dpr2 dps32(z3)"; "1" without any."""
    dp, zero = k["dp"], k.get("zero_stage", 0)
    if dp == 1:
        return "1"
    if not zero:
        return f"dpr{dp}"
    replicas = k.get("dp_replicate", 1)
    shard = f"dps{dp // replicas}(z{zero})"
    return f"dpr{replicas} {shard}" if replicas > 1 else shard


def register(app: typer.Typer) -> None:
    app.command()(plan)
