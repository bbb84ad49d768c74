"""Priors for the performance model in the benchmarks: what a cluster's database would hold.

A study on a cluster starts from the constants its earlier studies fitted (tuner.store.
latest_constants). The benchmarks replay one table at a time; `cold` starts from the defaults of
the table's device (tuner.perfconstants.default_constants: its published level, nothing measured
on the cluster),
`warm` from constants fitted to every OTHER table measured on the same cluster (same `gpu_type`),
never to the table being judged.

Public tables were measured with frameworks that materialise the s x s attention scores
(Megatron-LM 2021-22, Megatron-DeepSpeed, DeepSpeed, OneFlow: none ran flash attention), so their
priors say `flash_attention=False`; our own trainer runs SDPA (no stored scores).

    .venv/bin/python -m bench.priors --fit-cpu-defaults   # the CPU defaults in tuner/perfconstants.py
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from bench.validation_data import Measurement, load_csv
from tuner import fitting, perfconstants
from tuner.pricing import Pricing
from tuner.spec import ClusterSpec, TrainingSpec

ROOT = Path(__file__).resolve().parent.parent

PRIORS = ("cold", "warm")
OWN_DATASET = "own_tables"  # bench/own_tables/: measured by this project's trainer
# The tables the CPU defaults are fitted on (the "dev" own tables of bench/model_validation.py);
# every other own table is held out from them: the gpt-deep table and the 2D table. Both 8-rank
# and both 4-node gpt-small/tiny tables: the same layouts measured ~1.2x apart on two occasions
# (docs/benchmarks.md, "Collectives from their parts"), so a fit on one occasion alone moves the
# other's level by that much.
CPU_DEFAULT_TABLES = (
    "own_gpt-tiny_8rank_gbs16.csv",
    "own_gpt-small_8rank_gbs16.csv",
    "own_gpt-small_4node_200mbit_gbs16.csv",
    "own_gpt-small_4node_unshaped_gbs16.csv",
)


def inputs(row: Measurement) -> fitting.Measurement:
    """A table row as calibrate() input (estimate() pads the vocabulary as Megatron does)."""
    return fitting.Measurement(
        row.model, row.parallel, ClusterSpec(**row.cluster), row.iteration_time_s or 0.0, row.precision
    )


def pricing(row: Measurement, constants: perfconstants.ModelConstants | None = None) -> Pricing:
    """The pricing a study of the row's table would use: its model, cluster and dtype (fp16 tables
    price as bf16: the same bytes and, on these GPUs, the same peak), `constants` (default: cold),
    and a mixture of experts' imbalance (prior_imbalance)."""
    dtype = "fp32" if row.precision == "fp32" else "bf16"
    return Pricing(row.model, ClusterSpec(**row.cluster), dtype, constants or cold(row), prior_imbalance(row))


def prior_imbalance(row: Measurement) -> float:
    """A mixture of experts' max/mean tokens per expert as a study prices it before any trial: the
    study default (training.moe_imbalance; our MoE tables route as the model learns, learned
    routing). 1 for a dense model."""
    # the experts' imbalance prior; a dense model has no experts to imbalance
    return TrainingSpec.model_fields["moe_imbalance"].default if row.model.moe else 1.0


def cold(row: Measurement) -> perfconstants.ModelConstants:
    """The defaults of the row's device kind, as the framework that measured it ran attention."""
    c = perfconstants.default_constants(ClusterSpec(**row.cluster))
    return c if row.dataset == OWN_DATASET else dataclasses.replace(c, flash_attention=False)


def prior(kind: str, path: Path, tables: list[Path]) -> perfconstants.ModelConstants:
    """The constants a study of the table at `path` would start from."""
    rows = load_csv(path)
    if kind == "cold":
        return cold(rows[0])
    if kind != "warm":
        raise ValueError(f"unknown prior {kind!r}; valid: {list(PRIORS)}")
    cluster = rows[0].cluster
    others = [
        inputs(r)
        for p in tables
        if p.resolve() != path.resolve()
        for r in load_csv(p)
        if r.status == "ok" and r.iteration_time_s and r.cluster == cluster
    ]
    return fitting.calibrate(others, cold(rows[0])) if others else cold(rows[0])


# Fitted for the CPU defaults: what a study calibrates, plus the price of memory-bound work (a CPU
# core moves ~10 GB/s against 0.05 TFLOP/s, nothing like a GPU's 2 TB/s against 312), the wait
# behind the compute before a blocking collective and the scale of the framework's measured call
# costs. Not collective_overhead_s: on CPU ranks a call's cost is measured (CPU_CALL_S,
# bench/gloo_groups.py), never fitted to a table.
CPU_DEFAULT_FITTED = (
    *(name for name in perfconstants.FITTED if name != "collective_overhead_s"),
    "elementwise_flops_per_byte",
    "collective_wait_fraction",
    "framework_call_scale",
)


def fit_cpu_defaults(own_tables: Path = ROOT / "bench" / "own_tables") -> perfconstants.ModelConstants:
    """calibrate() on every layout that ran in the CPU_DEFAULT_TABLES, from the GPU defaults with
    the measured call costs of CPU ranks (and a wait of half the compute to start from)."""
    rows = [r for name in CPU_DEFAULT_TABLES for r in load_csv(own_tables / name)]
    points = [inputs(r) for r in rows if r.status == "ok" and r.iteration_time_s]
    start = perfconstants.ModelConstants(cpu_call_s=perfconstants.CPU_CALL_S, collective_wait_fraction=0.5)
    return fitting.calibrate(points, start, fitted=CPU_DEFAULT_FITTED)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--fit-cpu-defaults", action="store_true", help="print the fitted CPU defaults")
    args = parser.parse_args()
    if args.fit_cpu_defaults:
        fitted = fit_cpu_defaults()
        for name in CPU_DEFAULT_FITTED:
            print(f"{name}={getattr(fitted, name):.4g}")


if __name__ == "__main__":
    main()
