"""How many real trials does each sampler need to find a near-best layout?

    .venv/bin/python -m bench.search_efficiency [--seeds 20] [--table FILE ...] [--samplers ...] [--json]

Ground truth is a table of REAL measured trials (the column format of
bench/data/README.md). Each sampler searches the table's layouts; a replay
dispatcher looks each proposed layout up in the table (its measured time, or its OOM/failure).
Reported per table and sampler: the median and 90th percentile number of trials until a layout
within 5 % of the table's best is found, and the median device-seconds spent (each trial costs
STEPS_PER_TRIAL iterations x its time x the GPUs; a failed one, one iteration).
Default tables: our own (bench/own_tables/, measured by bench/measure_table.py) and the vTrain
8-GPU tables with >= 12 layouts (bench/data/vtrain_single_node).
Targets (issue 13): `model` needs <= 1/3 of `tpe`'s trials and <= 1/5 of `random`'s on each of our
own tables and over all tables, and <= 3 trials over all tables, from a cold prior.
`--prior cold` (default) starts every sampler that uses the performance model from its device
kind's default constants (GPU or CPU ranks; public tables without flash attention: bench/priors.py);
`--prior warm` from constants fitted to the other tables of the same cluster, as a cluster's
database would after earlier studies. `tpe` and `nsga2` are warm-started with the model's best
prediction, so on a table where that first guess is within 5 % they need 1 trial too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import warnings
from pathlib import Path

from bench.priors import PRIORS, pricing, prior
from bench.validation_data import DATA_DIR, Measurement, load_csv
from tuner.outcome import FailureKind, Outcome
from tuner.perfconstants import ModelConstants
from tuner.samplers import SAMPLERS, make_sampler

ROOT = Path(__file__).resolve().parent.parent

WITHIN = 0.05
STEPS_PER_TRIAL = 10
MIN_LAYOUTS = 12


# Baselines that are not product samplers: optuna's TPE / NSGA-II without the model's warm start.
# The product's tpe and nsga2 run the model's best-predicted layout first, so wherever that first
# guess is within 5 % of the best they need 1 trial, as `model` does: against them a ratio says
# nothing about search. The plain ones say what the search itself costs.
PLAIN = {"tpe-plain": "tpe", "nsga2-plain": "nsga2"}


def _p90(values: list[float]) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(0.9 * (len(s) - 1)))]


def search(
    rows: list[Measurement], sampler_name: str, seed: int, constants: ModelConstants | None = None
) -> tuple[int, float]:
    """(trials, device-seconds) until a layout within WITHIN of the best is measured."""
    by_layout = {r.parallel: r for r in rows}
    ok = [r for r in rows if r.status == "ok" and r.iteration_time_s]
    best_time = min(r.iteration_time_s for r in ok)
    first = rows[0]  # estimate() pads the vocabulary for each layout's tp, as Megatron does
    if sampler_name in PLAIN:  # optuna on its own: no warm start from the model's first guess
        from tuner.samplers.external import OptunaSampler

        sampler = OptunaSampler(list(by_layout), seed, kind=PLAIN[sampler_name])
    else:
        sampler = make_sampler(sampler_name, list(by_layout), seed=seed, pricing=pricing(first, constants))
    trials, device_s = 0, 0.0
    while (config := sampler.ask()) is not None:
        trials += 1
        row = by_layout[config]
        gpus = config.world_size
        if row.status == "ok" and row.iteration_time_s:
            device_s += STEPS_PER_TRIAL * row.iteration_time_s * gpus
            tokens = row.global_batch_size * row.model.seq_len / row.iteration_time_s
            sampler.tell(config, Outcome(ok=True, tokens_per_s=tokens, step_time_s=row.iteration_time_s))
            if row.iteration_time_s <= best_time * (1 + WITHIN):
                return trials, device_s
        else:
            device_s += best_time * gpus
            kind = FailureKind.OOM if row.status == "oom" else FailureKind.CRASH
            sampler.tell(config, Outcome.failed(kind, row.status))
    return trials, device_s


OWN_TABLES = ROOT / "bench" / "own_tables"  # measured on this project's machines (bench/measure_table.py)


def default_tables() -> list[Path]:
    paths = sorted(OWN_TABLES.glob("*.csv")) + sorted((DATA_DIR / "vtrain_single_node").glob("*8gpu*.csv"))
    return [p for p in paths if len(load_csv(p)) >= MIN_LAYOUTS]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--table", action="append", type=Path, help="a table CSV (repeatable)")
    parser.add_argument("--samplers", default=",".join(SAMPLERS),
                        help=f"product samplers {list(SAMPLERS)} and the baselines {list(PLAIN)}")  # fmt: skip
    parser.add_argument("--prior", choices=PRIORS, default="cold",
                        help="the performance model's constants at the start: defaults, or fitted to "
                        "the other tables of the same cluster (bench/priors.py)")  # fmt: skip
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    tables = args.table or default_tables()
    out: dict[str, dict[str, dict[str, float]]] = {}
    for path in tables:
        rows = load_csv(path)
        constants = prior(args.prior, path, tables)
        out[path.stem] = {}
        for name in args.samplers.split(","):
            runs = [search(rows, name, seed, constants) for seed in range(args.seeds)]
            out[path.stem][name] = {
                "median_trials": statistics.median(t for t, _ in runs), "p90_trials": _p90([t for t, _ in runs]),
                "median_device_s": statistics.median(d for _, d in runs), "layouts": len(rows),
            }  # fmt: skip
        if not args.json:
            cells = "  ".join(
                f"{n} {v['median_trials']:.0f}/{v['p90_trials']:.0f}" for n, v in out[path.stem].items()
            )
            print(f"{path.stem} ({len(rows)} layouts): median/p90 trials  {cells}", flush=True)
    if args.json:
        print(json.dumps({"tables": out}))
        return
    print("\nmedian over tables of the median trials to within 5 % of the best:")
    names = args.samplers.split(",")
    overall = {}
    for name in names:
        meds = [t[name]["median_trials"] for t in out.values()]
        devs = [t[name]["median_device_s"] for t in out.values()]
        overall[name] = statistics.median(meds)
        print(f"  {name:>11}: {overall[name]:5.1f} trials, {statistics.median(devs):8.1f} device-s")
    if {"model", "tpe", "random"} <= set(names):
        print("\nmodel / tpe (target <= 0.33) and model / random (target <= 0.20), median trials:")
        rows = [
            (k, {n: v[n]["median_trials"] for n in names}) for k, v in out.items() if k.startswith("own_")
        ]
        plain = "tpe-plain" in names
        if plain:
            print("  (and model / tpe-plain: optuna's TPE without the model's warm start)")
        for label, t in [*rows, ("all tables", overall)]:
            extra = f", {t['model'] / t['tpe-plain']:.2f}" if plain else ""
            print(f"  {label:>40}: {t['model'] / t['tpe']:.2f}, {t['model'] / t['random']:.2f}{extra}")


if __name__ == "__main__":
    main()
