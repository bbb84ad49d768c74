"""How well does the performance model rank layouts it was never fitted to?

    .venv/bin/python bench/model_validation.py [--details]

For every table of public GPU measurements in bench/data/ (bench/validation_data.py loads them),
with at least MIN_ROWS layouts that ran:
- uncalibrated: Spearman rho between predicted and measured iteration time over all its layouts,
  with the default ModelConstants (nothing fitted to any table);
- calibrated: calibrate() on 3 layouts of the table (a fixed pseudo-random pick, seeded by the
  table id, not by the measurements), then rho and the median absolute relative error of the
  predicted time over the table's OTHER layouts.
Targets (issue 3): median rho >= 0.8 uncalibrated, >= 0.9 calibrated.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scipy.stats import spearmanr  # noqa: E402

from bench.validation_data import Measurement, load_tables, megatron_padded_vocab  # noqa: E402
from tuner import perfmodel  # noqa: E402
from tuner.spec import ClusterSpec  # noqa: E402

MIN_ROWS = 4  # a rank correlation over fewer layouts says little
NUM_CALIBRATION = 3


def _inputs(row: Measurement) -> perfmodel.Measurement:
    # Megatron pads the vocabulary to a multiple of 128 * tp; the measured runs had that vocab.
    model = dataclasses.replace(
        row.model, vocab_size=megatron_padded_vocab(row.model.vocab_size, row.parallel.tp)
    )
    return perfmodel.Measurement(
        model, row.parallel, ClusterSpec(**row.cluster), row.iteration_time_s, row.precision
    )


def _predict(m: perfmodel.Measurement, constants: perfmodel.ModelConstants) -> float:
    return perfmodel.estimate(m.model, m.parallel, m.cluster, m.precision, constants).step_time_s


def _rho(predicted: list[float], measured: list[float]) -> float | None:
    if len(set(measured)) < 2 or len(set(predicted)) < 2:
        return None  # all ties: no ranking to agree with
    return float(spearmanr(predicted, measured).statistic)


def evaluate(table_id: str, rows: list[Measurement]) -> dict | None:
    ok = [_inputs(r) for r in rows if r.status == "ok" and r.iteration_time_s]
    if len(ok) < MIN_ROWS:
        return None
    measured = [m.step_time_s for m in ok]
    default = perfmodel.ModelConstants()
    out = {
        "table": table_id,
        "rows": len(ok),
        "rho_uncal": _rho([_predict(m, default) for m in ok], measured),
    }
    rng = random.Random(zlib.crc32(table_id.encode()))
    chosen = set(rng.sample(range(len(ok)), NUM_CALIBRATION))
    fitted = perfmodel.calibrate([ok[i] for i in chosen])
    held = [m for i, m in enumerate(ok) if i not in chosen]
    pred = [_predict(m, fitted) for m in held]
    out["rho_cal"] = _rho(pred, [m.step_time_s for m in held]) if len(held) >= 3 else None
    errors = [abs(p - m.step_time_s) / m.step_time_s for p, m in zip(pred, held, strict=True)]
    out["mape_cal"] = statistics.median(errors) if errors else None
    out["mape_uncal"] = statistics.median(
        abs(_predict(m, default) - m.step_time_s) / m.step_time_s for m in ok
    )
    return out


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
    args = parser.parse_args()
    tables = {
        tid: rows for tid, rows in load_tables().items()
        if (not args.only or args.only in tid) and (not args.exclude or args.exclude not in tid)
    }  # fmt: skip
    results = [r for tid, rows in sorted(tables.items()) if (r := evaluate(tid, rows)) is not None]
    groups: dict[str, list[dict]] = {}
    for r in results:
        groups.setdefault(r["table"].split("_")[0], []).append(r)
    print("| group | tables | layouts | median rho uncalibrated | median rho calibrated (held out) | "
          "median abs. error uncalibrated | median abs. error calibrated (held out) |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, rs in [*sorted(groups.items()), ("all", results)]:
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
    skipped = [tid for tid, rows in tables.items() if evaluate(tid, rows) is None]
    print(
        f"\n{len(skipped)} tables with fewer than {MIN_ROWS} layouts that ran are not scored: {', '.join(sorted(skipped))}"
    )


if __name__ == "__main__":
    main()
