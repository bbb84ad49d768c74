"""How well does the performance model rank layouts it was never fitted to?

    .venv/bin/python -m bench.model_validation [--details] [--own]

For every table of public GPU measurements in bench/data/ (bench/validation_data.py loads them),
with at least MIN_ROWS layouts that ran:
- uncalibrated: Spearman rho between predicted and measured iteration time over all its layouts,
  with the default ModelConstants (nothing fitted to any table);
- calibrated: calibrate() on 3 layouts of the table (a fixed pseudo-random pick, seeded by the
  table id, not by the measurements), then rho and the median absolute relative error of the
  predicted time over the table's OTHER layouts.
Targets (issue 3): median rho >= 0.8 uncalibrated, >= 0.9 calibrated.
Tables any constant was fitted or chosen on (DEV_TABLES: the vTrain h1024 tables for the overhead
defaults, Korthikanti table 5 for the memory-bound traffic by its MFU trend) are reported apart
from the held-out ones. Then the level (issue 25): the uncalibrated absolute error per device kind
and model size, every table that ran (also those with fewer than MIN_ROWS layouts): median
|predicted / measured - 1| of the step time and of the MFU, and the median predicted / measured
step time (above 1: the model is pessimistic, below 1: optimistic).
Then the MFU trend across model sizes (issue 13) on Korthikanti table 5 and the BigScience
BLOOM-prequel tables: predicted / measured MFU, uncalibrated, should not drift with size (target:
every table within 10 % of its group's median ratio).
The cold constants are tuner.perfconstants.default_constants of the table's device kind, with
flash_attention off for public tables (bench/priors.py: cold).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import zlib
from pathlib import Path

from scipy.stats import spearmanr

from bench.priors import CPU_DEFAULT_TABLES, cold, inputs
from bench.validation_data import Measurement, load_csv, load_tables
from tuner import fitting, perfconstants, perfmodel, spec

ROOT = Path(__file__).resolve().parent.parent

MIN_ROWS = 4  # a rank correlation over fewer layouts says little
NUM_CALIBRATION = 3
# Tables a default constant was fitted or chosen on (docs/perfmodel.md, "Constants and
# calibration"): the vTrain h1024 tables (the overheads) and Korthikanti table 5 (the memory-bound
# traffic, chosen by its MFU trend). Every other public table is held out.
DEV_TABLES = ("vtrain_single_h1024", "korthikanti_tab5")
SIZE_BUCKETS = ((1e9, "< 1B"), (10e9, "1-10B"), (100e9, "10-100B"), (math.inf, ">= 100B"))


def split(table_id: str) -> str:
    """dev: a default constant was fitted or chosen on the table (own tables: the CPU defaults'
    fit, bench/priors.py CPU_DEFAULT_TABLES); every other table is held out."""
    if table_id.startswith("own_"):
        return "dev" if f"{table_id}.csv" in CPU_DEFAULT_TABLES else "held out"
    return "dev" if table_id.startswith(DEV_TABLES) else "held out"


def _predict(m: fitting.Measurement, constants: perfconstants.ModelConstants) -> float:
    return perfmodel.estimate(m.model, m.parallel, m.cluster, m.precision, constants).step_time_s


def _rho(predicted: list[float], measured: list[float]) -> float | None:
    if len(set(measured)) < 2 or len(set(predicted)) < 2:
        return None  # all ties: no ranking to agree with
    return float(spearmanr(predicted, measured).statistic)


def evaluate(table_id: str, rows: list[Measurement]) -> dict | None:
    ok = [inputs(r) for r in rows if r.status == "ok" and r.iteration_time_s]
    if len(ok) < MIN_ROWS:
        return None
    measured = [m.step_time_s for m in ok]
    default = cold(rows[0])
    out = {
        "table": table_id,
        "rows": len(ok),
        "rho_uncal": _rho([_predict(m, default) for m in ok], measured),
    }
    rng = random.Random(zlib.crc32(table_id.encode()))
    chosen = set(rng.sample(range(len(ok)), NUM_CALIBRATION))
    fitted = fitting.calibrate([ok[i] for i in chosen], default)
    held = [m for i, m in enumerate(ok) if i not in chosen]
    pred = [_predict(m, fitted) for m in held]
    out["rho_cal"] = _rho(pred, [m.step_time_s for m in held]) if len(held) >= 3 else None
    errors = [abs(p - m.step_time_s) / m.step_time_s for p, m in zip(pred, held, strict=True)]
    out["mape_cal"] = statistics.median(errors) if errors else None
    out["mape_uncal"] = statistics.median(
        abs(_predict(m, default) - m.step_time_s) / m.step_time_s for m in ok
    )
    return out


# MFU across model sizes on the same hardware (issue 13): published per-GPU throughput rises with
# model size. Per table, the measured MFU of each layout (PaLM's formula, the padded vocabulary)
# against the uncalibrated prediction; the trend is right when prediction / measurement is the
# same at every size, so each group reports ratio / (median ratio of the group) - 1.
TREND_GROUPS = {
    "Korthikanti table 5 (A100, TP8; selective recompute + SP)": ("korthikanti", "selective"),
    "Korthikanti table 5 (A100, TP8; full recompute)": ("korthikanti", "full"),
    "BigScience BLOOM prequel (A100, TP8, full recompute)": ("bigscience_bloomprequel", "full"),
}
TREND_TOLERANCE = 0.10


def mfu_trend(tables: dict[str, list[Measurement]], prefix: str, checkpoint: str) -> list[dict]:
    """One row per table: size, measured and predicted MFU (median over its layouts), their ratio."""
    out = []
    for tid, rows in sorted(tables.items()):
        ok = [r for r in rows if tid.startswith(prefix) and r.status == "ok" and r.iteration_time_s
              and r.parallel.activation_checkpoint == checkpoint]  # fmt: skip
        if not ok:
            continue
        measured, predicted = [], []
        for r in ok:
            m = inputs(r)
            est = perfmodel.estimate(m.model, m.parallel, m.cluster, m.precision, cold(r))
            measured.append(est.mfu * est.step_time_s / m.step_time_s)  # same FLOPs, measured time
            predicted.append(est.mfu)
        size = spec.padded_model(ok[0].model, ok[0].parallel.tp).num_params
        out.append({"table": tid, "params": size, "mfu": statistics.median(measured),
                    "mfu_pred": statistics.median(predicted),
                    "ratio": statistics.median(p / q for p, q in zip(predicted, measured, strict=True))})  # fmt: skip
    if out:
        mid = statistics.median(r["ratio"] for r in out)
        for r in out:
            r["trend_error"] = r["ratio"] / mid - 1
    return sorted(out, key=lambda r: r["params"])


def print_trends(tables: dict[str, list[Measurement]]) -> None:
    print("\nMFU across model sizes, uncalibrated (trend error = (predicted / measured) / its median "
          f"over the group - 1; target within {TREND_TOLERANCE:.0%}):")  # fmt: skip
    for title, (prefix, checkpoint) in TREND_GROUPS.items():
        rows = mfu_trend(tables, prefix, checkpoint)
        if not rows:
            continue
        worst = max(abs(r["trend_error"]) for r in rows)
        print(f"\n{title}: worst trend error {worst:+.0%}\n\n| table | parameters | measured MFU | "
              "predicted MFU | predicted / measured | trend error |\n| --- | --- | --- | --- | --- | --- |")  # fmt: skip
        for r in rows:
            print(f"| {r['table']} | {r['params'] / 1e9:.0f}B | {r['mfu']:.1%} | {r['mfu_pred']:.1%} | "
                  f"{r['ratio']:.2f} | {r['trend_error']:+.0%} |")  # fmt: skip


def levels(tables: dict[str, list[Measurement]]) -> list[dict]:
    """One entry per layout that ran: its split, device, size bucket and predicted / measured step
    time, uncalibrated (the level, not the ranking: what MFU a plan promises)."""
    out = []
    for tid, rows in sorted(tables.items()):
        for r in rows:
            if r.status != "ok" or not r.iteration_time_s:
                continue
            m = inputs(r)
            size = spec.padded_model(r.model, r.parallel.tp).num_params
            bucket = next(name for limit, name in SIZE_BUCKETS if size < limit)
            out.append({"table": tid, "split": split(tid), "device": r.cluster["device"], "size": bucket,
                        "ratio": _predict(m, cold(r)) / m.step_time_s})  # fmt: skip
    return out


def print_levels(tables: dict[str, list[Measurement]]) -> None:
    rows = levels(tables)
    print("\nLevels, uncalibrated (every layout that ran; step error = |predicted / measured - 1| of the "
          "step time, MFU error = |measured / predicted - 1|; bias = median predicted / measured step "
          "time, < 1 optimistic):\n")  # fmt: skip
    print("| split | device | model size | tables | layouts | median step error | median MFU error | bias |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    sizes = [name for _, name in SIZE_BUCKETS]
    for sp in ("dev", "held out"):
        part = [r for r in rows if r["split"] == sp]
        groups: dict[tuple[str, str], list[dict]] = {}
        for r in sorted(part, key=lambda r: (r["device"], sizes.index(r["size"]))):
            groups.setdefault((r["device"], r["size"]), []).append(r)
        if part:
            groups["all", "all"] = part
        for (device, size), group in groups.items():
            ratios = [r["ratio"] for r in group]
            print(f"| {sp} | {device} | {size} | {len({r['table'] for r in group})} | {len(group)} | "
                  f"{statistics.median(abs(x - 1) for x in ratios):.0%} | "
                  f"{statistics.median(abs(1 / x - 1) for x in ratios):.0%} | {statistics.median(ratios):.2f} |")  # fmt: skip


def _median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _fmt(v: float | None, pct: bool = False) -> str:
    if v is None:
        return "-"
    return f"{v:.0%}" if pct else f"{v:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--details", action="store_true", help="one line per table")
    parser.add_argument("--only", help="score only tables whose id contains this text")
    parser.add_argument("--exclude", help="skip tables whose id contains this text")
    parser.add_argument("--no-trends", action="store_true", help="leave out the MFU-across-sizes tables")
    parser.add_argument(
        "--own",
        action="store_true",
        help="score this project's CPU tables (bench/own_tables) instead of the public ones",
    )
    args = parser.parse_args()
    if args.own:
        source = {path.stem: load_csv(path) for path in sorted((ROOT / "bench" / "own_tables").glob("*.csv"))}
    else:
        source = load_tables()
    tables = {
        tid: rows for tid, rows in source.items()
        if (not args.only or args.only in tid) and (not args.exclude or args.exclude not in tid)
    }  # fmt: skip
    results = [r for tid, rows in sorted(tables.items()) if (r := evaluate(tid, rows)) is not None]
    # The dev tables apart from the held-out ones, by dataset.
    groups: dict[str, list[dict]] = {}
    for sp in ("dev", "held out"):
        part = [r for r in results if split(r["table"]) == sp]
        for r in part:
            groups.setdefault(f"{sp}: {r['table'].split('_')[0]}", []).append(r)
        if part:
            groups[f"{sp}: all"] = part
    print("| group | tables | layouts | median rho uncalibrated | median rho calibrated (held out) | "
          "median abs. error uncalibrated | median abs. error calibrated (held out) |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, rs in [*groups.items(), ("all", results)]:
        print(
            f"| {name} | {len(rs)} | {sum(r['rows'] for r in rs)} | {_fmt(_median([r['rho_uncal'] for r in rs]))} | "
            f"{_fmt(_median([r['rho_cal'] for r in rs]))} | {_fmt(_median([r['mape_uncal'] for r in rs]), True)} | "
            f"{_fmt(_median([r['mape_cal'] for r in rs]), True)} |"
        )
    if args.details:
        print(
            "\n| table | layouts | rho uncal | rho cal | err uncal | err cal |\n| --- | --- | --- | --- | --- | --- |"
        )
        for r in results:
            print(f"| {r['table']} | {r['rows']} | {_fmt(r['rho_uncal'])} | {_fmt(r['rho_cal'])} | "
                  f"{_fmt(r['mape_uncal'], True)} | {_fmt(r['mape_cal'], True)} |")  # fmt: skip
    if not args.own:
        print_levels(tables)
    if not args.no_trends and not args.own:
        print_trends(tables)
    skipped = [tid for tid, rows in tables.items() if evaluate(tid, rows) is None]
    print(
        f"\n{len(skipped)} tables with fewer than {MIN_ROWS} layouts that ran are not scored: {', '.join(sorted(skipped))}"
    )


if __name__ == "__main__":
    main()
