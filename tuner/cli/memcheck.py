"""`tuner memcheck` and `tuner plan --verify-memory`: a layout's memory from the memory oracle
(trainer/memcheck.py: the trainer built at full size on fake tensors), beside the analytic model's.

The oracle needs torch (the trainer extra); it is imported only when a check runs, so the CLI stays
torch-free. What the oracle cannot see (allocator, communication buffers, CUDA context) is added
as the analytic model adds it: tensor bytes x memory_scale + workspace_bytes, the calibrated part.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from trainer.contract.parallel import ParallelConfig
from tuner.cli.common import fail, stored_constants
from tuner.cli.options import SpecOptions, spec_data, with_spec_options
from tuner.perfconstants import ModelConstants, default_constants
from tuner.plan import PlanError, parse_pins
from tuner.plan import plan as run_plan
from tuner.pricing import Pricing
from tuner.space import layout
from tuner.spec import SpecError, StudySpec, benchmark_config, parse_spec


def check(
    study: StudySpec,
    config: ParallelConfig,
    constants: ModelConstants,
    *,
    all_stages: bool = False,
    exact: bool = False,
    processes: int | None = None,
) -> dict[str, Any]:
    """The oracle's and the analytic model's memory of one layout of the study."""
    try:
        from trainer.memcheck import Simulator, memcheck
    except ImportError as e:  # the CLI runs without torch; the oracle does not
        raise PlanError(
            f"the memory oracle needs torch (pip install 'parallel-tuner[trainer]'): {e}"
        ) from None
    # routing is an option of the experts only (a dense model has none to report)
    routing = study.training.moe_routing if study.as_model_config().moe else None
    if routing == "learned":
        # Learned routing's tokens per expert depend on the data: the oracle simulates balanced
        # routing (trainer/memcheck.py), and the model is priced the same way beside it.
        study = study.model_copy(
            update={"training": study.training.model_copy(update={"moe_routing": "balanced"})}
        )
    cfg = benchmark_config(study, config)
    gpu = cfg.device == "cuda"
    report = memcheck(
        cfg, all_stages=all_stages, extrapolate=gpu and not exact, simulator=Simulator(processes)
    )
    c, cluster = constants, study.cluster
    est = Pricing.for_study(study, c).estimate(config)  # in the dtype the oracle's trainer builds
    total = report.peak_bytes * c.memory_scale + c.workspace_bytes
    budget = cluster.device_memory_bytes * (1 - c.memory_margin)
    worst = report.worst
    return {
        "oracle": {
            "tensor_bytes": report.peak_bytes, "memory_bytes": total, "fits": total <= budget,
            "worst_rank": worst.rank, "coords": worst.coords, "phase": worst.phase, "breakdown": worst.breakdown,
            "ranks": [{"rank": r.rank, "coords": r.coords, "tensor_bytes": r.peak_bytes, "phase": r.phase}
                      for r in report.ranks],
            "device": report.device, "dtype": report.dtype, "microbatches_simulated": report.microbatches_simulated,
            "seconds": report.seconds,
            **({"moe_routing": "balanced (the study's learned routing is data dependent)"} if routing == "learned" else {}),
        },
        "predicted": {
            "tensor_bytes": (est.memory_bytes - c.workspace_bytes) / c.memory_scale, "memory_bytes": est.memory_bytes,
            "fits": est.fits,
        },
        "calibrated": {"workspace_bytes": c.workspace_bytes, "memory_scale": c.memory_scale,
                       "budget_bytes": budget},
    }  # fmt: skip


def verify_candidates(study: StudySpec, result: dict[str, Any], constants: ModelConstants | None) -> None:
    """Add the oracle's check to every candidate of a `tuner plan` result (in place)."""
    c = constants or default_constants(study.cluster)
    for cand in result["candidates"]:
        config = _config_of(cand["config"])
        cand["memcheck"] = check(study, config, c)


def _config_of(knobs: dict[str, Any]) -> ParallelConfig:
    """A candidate's ParallelConfig (plan lists dp whole; the space splits it by zero stage)."""
    return layout(**knobs)


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"


def print_check(config: ParallelConfig, result: dict[str, Any]) -> None:
    o, pred, cal = result["oracle"], result["predicted"], result["calibrated"]
    error = (pred["tensor_bytes"] - o["tensor_bytes"]) / o["tensor_bytes"]
    where = " ".join(f"{k}={v}" for k, v in o["coords"].items() if getattr(config, k) > 1) or "the only rank"
    simulated = (
        f", micro-batches extended from {o['microbatches_simulated']}" if o["microbatches_simulated"] else ""
    )
    routing = f", routing {o['moe_routing']}" if "moe_routing" in o else ""
    typer.echo(f"{config.describe()}: peak {_size(o['tensor_bytes'])} of tensors on rank {o['worst_rank']} "
               f"({where}) during {o['phase']} [{o['device']} {o['dtype']}{simulated}{routing}; "
               f"{o['seconds']:.0f} s]")  # fmt: skip
    for name, value in o["breakdown"].items():
        typer.echo(f"  {name:<20} {_size(value):>12}")
    verdict = "fits" if o["fits"] else "does NOT fit"
    typer.echo(f"  + calibrated workspace {_size(cal['workspace_bytes'])}, x memory_scale {cal['memory_scale']:g}: "
               f"{_size(o['memory_bytes'])} of {_size(cal['budget_bytes'])} usable: {verdict}")  # fmt: skip
    typer.echo(f"  analytic model: {_size(pred['tensor_bytes'])} of tensors ({error:+.1%}), "
               f"{'fits' if pred['fits'] else 'does not fit'}")  # fmt: skip
    if len(o["ranks"]) > 1:
        typer.echo("  per rank: " + ", ".join(f"{r['rank']}: {_size(r['tensor_bytes'])} ({r['phase']})"
                                              for r in o["ranks"]))  # fmt: skip


@with_spec_options
def memcheck(
    ctx: typer.Context,
    opts: SpecOptions,
    all_stages: Annotated[
        bool, typer.Option("--all-stages", help="every pipeline rank, not only the first and last")
    ] = False,
    exact: Annotated[
        bool, typer.Option("--exact", help="simulate every micro-batch (default on GPUs: extend two counts)")
    ] = False,
    processes: Annotated[
        int | None, typer.Option(help="ranks simulated at once (default: the CPU cores)")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the check as JSON")] = False,
) -> None:
    """Check one layout's memory with the memory oracle: the trainer built at full size on fake
    tensors and a fake process group, stepped once with the schedule's micro-batches and the
    optimizer; peak per rank (worst stage) and what it holds. Model, cluster and precision as
    `tuner plan` takes them; --config pins the layout (the planner's best among the layouts that
    agree with the pins is checked)."""
    try:
        study = parse_spec(spec_data(opts), str(opts.spec) if opts.spec else "memcheck")
        constants = stored_constants(study.cluster.name) or default_constants(study.cluster)
        ranked = run_plan(study, pins=parse_pins(opts.config), top=1, include_unfit=True, constants=constants)
        if not ranked["candidates"]:
            raise PlanError("no valid layout agrees with --config")
        config = _config_of(ranked["candidates"][0]["config"])
        result = check(study, config, constants, all_stages=all_stages, exact=exact, processes=processes)
    except (SpecError, PlanError, ValueError) as e:
        fail(str(e))
    if as_json:
        typer.echo(json.dumps({"config": config.to_dict(), **result}, indent=1))
        return
    print_check(config, result)


def register(app: typer.Typer) -> None:
    app.command()(memcheck)


def print_verified(result: dict[str, Any]) -> None:
    typer.echo("\nmemory oracle (the trainer on fake tensors) for the layouts listed:")
    for cand in result["candidates"]:
        print_check(_config_of(cand["config"]), cand["memcheck"])
