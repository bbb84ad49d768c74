"""How accurate is the performance model after a study's first 5 trials?

    .venv/bin/python -m bench.model_accuracy [--seeds 10] [--table FILE ...] [--json]

On the tables bench/search_efficiency.py replays (our own CPU tables in bench/own_tables/ and the
vTrain 8-GPU tables, or --table FILE):
- throughput: from the defaults (`--prior cold`) or from constants fitted to the other tables of
  the same cluster (`--prior warm`, bench/priors.py), calibrate() on 5 layouts that ran (a seeded
  random pick, as the `model` sampler would have measured 5), then the Spearman rank correlation
  between predicted and measured throughput over the table's OTHER layouts; the median over
  `--seeds` picks. Target: >= 0.9.
- peak memory: the median relative error of the predicted peak memory against the measured one,
  per table, over every row that reports it: our own tables and every public table in bench/data/
  with a memory column; uncalibrated, and after fit_memory_scale() on min(5, n/2) rows of the
  table (judged on the others, median over seeds). On our CPU tables the measured figure is the
  trainer's live-tensor peak (no CUDA context or allocator), so the prediction there leaves out
  the model's `workspace_bytes`; on GPU tables it is the whole prediction against what the source
  reports. Target: <= 10 %.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import warnings
from pathlib import Path

from scipy.stats import spearmanr

from bench.priors import PRIORS, inputs, prior
from bench.search_efficiency import default_tables
from bench.validation_data import Measurement, load_csv, load_tables
from tuner import fitting, memmodel, perfconstants, perfmodel

NUM_CALIBRATION = 5


def throughput_rho(
    rows: list[Measurement], seed: int, initial: perfconstants.ModelConstants | None = None
) -> float | None:
    ok = [inputs(r) for r in rows if r.status == "ok" and r.iteration_time_s]
    if len(ok) < NUM_CALIBRATION + 3:
        return None
    chosen = set(random.Random(seed).sample(range(len(ok)), NUM_CALIBRATION))
    fitted = fitting.calibrate([ok[i] for i in chosen], initial)
    held = [m for i, m in enumerate(ok) if i not in chosen]
    predicted = [
        perfmodel.estimate(m.model, m.parallel, m.cluster, m.precision, fitted).tokens_per_s for m in held
    ]
    measured = [1 / m.step_time_s for m in held]  # one global batch per step in every row
    if len(set(predicted)) < 2:
        return None
    return float(spearmanr(predicted, measured).statistic)


def memory_errors(rows: list[Measurement], seed: int | None = None) -> list[float]:
    """Relative errors of the predicted peak memory. With a seed: fit memory_scale on a seeded
    pick of min(5, n // 2) rows first, and score the other rows only."""
    pairs = []
    for r in rows:
        if r.peak_memory_gb and r.status == "ok":
            m = inputs(r)
            c = perfconstants.ModelConstants()
            if m.cluster.device_kind == "cpu":
                c = dataclasses.replace(c, workspace_bytes=0.0)
            pairs.append((m, r.peak_memory_gb * 1e9, c))
    if seed is not None:
        if len(pairs) < 2:
            return []
        chosen = set(random.Random(seed).sample(range(len(pairs)), min(NUM_CALIBRATION, len(pairs) // 2)))
        fitted = fitting.fit_memory_scale([(pairs[i][0], pairs[i][1]) for i in chosen], pairs[0][2])
        pairs = [(m, peak, fitted) for i, (m, peak, _) in enumerate(pairs) if i not in chosen]
    return [
        abs(memmodel.memory(m.model, m.parallel, m.precision, c)["memory_bytes"] - peak) / peak
        for m, peak, c in pairs
    ]


def memory_summary(rows: list[Measurement], seeds: int) -> dict | None:
    errs = memory_errors(rows)
    if not errs:
        return None
    cal = [statistics.median(e) for seed in range(seeds) if (e := memory_errors(rows, seed))]
    return {
        "rows": len(errs), "median_error": statistics.median(errs),
        "median_error_cal": statistics.median(cal) if cal else None,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--table", action="append", type=Path, help="a table CSV (repeatable)")
    parser.add_argument("--prior", choices=PRIORS, default="cold",
                        help="constants before the 5 trials: defaults, or fitted to the other tables "
                        "of the same cluster (bench/priors.py)")  # fmt: skip
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    tables = args.table or default_tables()
    out: dict = {"throughput": {}, "memory": {}}
    for path in tables:
        rows = load_csv(path)
        initial = prior(args.prior, path, tables)
        rhos = [r for seed in range(args.seeds) if (r := throughput_rho(rows, seed, initial)) is not None]
        if rhos:
            out["throughput"][path.stem] = {"median_rho": statistics.median(rhos), "min_rho": min(rhos)}
        if mem := memory_summary(rows, args.seeds):
            out["memory"][path.stem] = mem
    if not args.table:  # every public table that reports memory, too
        for table_id, rows in sorted(load_tables().items()):
            if table_id not in out["memory"] and (mem := memory_summary(rows, args.seeds)):
                out["memory"][table_id] = mem
    rho_all = [v["median_rho"] for v in out["throughput"].values()]
    own = [v["median_rho"] for k, v in out["throughput"].items() if k.startswith("own_")]
    mem = list(out["memory"].values())
    cal = [v["median_error_cal"] for v in mem if v["median_error_cal"] is not None]
    out["summary"] = {
        "median_rho": statistics.median(rho_all) if rho_all else None,
        "median_rho_own_tables": statistics.median(own) if own else None,
        "median_memory_error": statistics.median(v["median_error"] for v in mem) if mem else None,
        "median_memory_error_cal": statistics.median(cal) if cal else None,
        "memory_rows": sum(v["rows"] for v in mem),
    }
    if args.json:
        print(json.dumps(out))
        return
    print(f"Spearman rho of predicted vs measured throughput, after calibrating on {NUM_CALIBRATION} "
          f"trials from a {args.prior} prior (median over {args.seeds} picks; held-out layouts):")  # fmt: skip
    for name, v in out["throughput"].items():
        print(f"  {name:60s} {v['median_rho']:.2f} (worst pick {v['min_rho']:.2f})")
    print("\nmedian relative error of predicted peak memory: uncalibrated / memory_scale fitted on "
          f"min({NUM_CALIBRATION}, n/2) rows, judged on the others:")  # fmt: skip
    for name, v in out["memory"].items():
        cal = "-" if v["median_error_cal"] is None else f"{v['median_error_cal']:.1%}"
        print(f"  {name:60s} {v['median_error']:6.1%} / {cal:>6} over {v['rows']} rows")
    s = out["summary"]
    print(f"\nmedian rho over tables {s['median_rho']:.2f} (own tables {s['median_rho_own_tables']}); "
          f"median over tables of the memory error {s['median_memory_error']:.1%} uncalibrated, "
          f"{s['median_memory_error_cal']:.1%} calibrated ({s['memory_rows']} rows)")  # fmt: skip


if __name__ == "__main__":
    main()
