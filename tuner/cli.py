"""`tuner`: the command-line interface. Torch-free: trials run in their own processes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from trainer.config import MODEL_PRESETS, BenchmarkConfig, BenchmarkResult, ParallelConfig
from trainer.launch import run_local

app = typer.Typer(
    help="parallel-tuner: find the fastest way to train a GPT on a cluster.", no_args_is_help=True
)

# The demo's layouts: the tiny CPU model, global batch 8, each parallelism once.
DEMO_LAYOUTS = [
    ParallelConfig(micro_batch_size=8),
    ParallelConfig(micro_batch_size=2, num_microbatches=4),
    ParallelConfig(tp=2, micro_batch_size=8),
    ParallelConfig(tp=2, sequence_parallel=True, micro_batch_size=8),
    ParallelConfig(pp=2, micro_batch_size=2, num_microbatches=4),
    ParallelConfig(dp_replicate=2, micro_batch_size=4),
    ParallelConfig(dp_shard=2, zero_stage=3, micro_batch_size=4),
    ParallelConfig(tp=2, dp_shard=2, zero_stage=2, micro_batch_size=4),
]


@app.callback()
def main() -> None:
    """parallel-tuner command line."""


@app.command()
def version() -> None:
    """Print the installed version."""
    from importlib.metadata import version as dist_version

    typer.echo(dist_version("parallel-tuner"))


@app.command()
def demo(
    work_dir: Annotated[Path, typer.Option(help="where each trial writes config, log and result")] = Path(
        "runs/demo"
    ),
    model: Annotated[str, typer.Option(help=f"model preset, one of {sorted(MODEL_PRESETS)}")] = "gpt-tiny",
    steps: Annotated[int, typer.Option(min=1, help="measured steps per trial")] = 3,
    timeout_s: Annotated[float, typer.Option(help="per-trial wall-clock limit")] = 300.0,
) -> None:
    """Benchmark a small GPT on CPU over several layouts and print what each measured.

    Each layout runs as a local torchrun process group (gloo)."""
    if model not in MODEL_PRESETS:
        raise typer.BadParameter(
            f"unknown preset {model!r}; valid: {sorted(MODEL_PRESETS)}", param_hint="--model"
        )
    results: list[tuple[ParallelConfig, BenchmarkResult]] = []
    typer.echo(f"{'layout':<34} {'ranks':>5} {'status':>7} {'tokens/s':>10} {'TFLOP/s/dev':>11} "
               f"{'MFU':>6} {'peak MiB':>9} {'loss':>7}")  # fmt: skip
    for i, layout in enumerate(DEMO_LAYOUTS):
        cfg = BenchmarkConfig(model=MODEL_PRESETS[model], parallel=layout, device="cpu", measure_steps=steps)
        result = run_local(cfg, work_dir / f"trial-{i}", timeout_s=timeout_s)
        results.append((layout, result))
        loss = f"{result.losses[-1]:.3f}" if result.losses else "-"
        typer.echo(
            f"{layout.describe():<34} {layout.world_size:>5} {result.status:>7} {result.tokens_per_s:>10.0f} "
            f"{result.model_tflops_per_device:>11.4f} {result.mfu:>6.1%} "
            f"{result.peak_memory_bytes / 2**20:>9.2f} {loss:>7}"
        )
        if not result.ok:
            typer.echo(f"    {result.error.strip().splitlines()[-1] if result.error else ''}")
    ok = [(lay, r) for lay, r in results if r.ok]
    if not ok:
        typer.echo("no layout ran", err=True)
        raise typer.Exit(1)
    best_layout, best = max(ok, key=lambda lr: lr[1].tokens_per_s)
    typer.echo(f"\nfastest: {best_layout.describe()} at {best.tokens_per_s:.0f} tokens/s "
               f"({len(ok)}/{len(results)} layouts ran; results under {work_dir}/)")  # fmt: skip
    (work_dir / "summary.json").write_text(
        json.dumps([{"parallel": lay.to_dict(), "result": r.to_dict()} for lay, r in results], indent=1)
    )


if __name__ == "__main__":
    app()
