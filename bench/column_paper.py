"""On paper: where the performance model prefers 2D tensor parallelism (tp_col > 1), and by how
much, in the seed studies' settings and AxoNN's (80B on 1024 A100s, small and large batches).

    .venv/bin/python -m bench.column_paper [--json]

For each setting: the planner's fastest layout predicted to fit with the study's space as written
(tp_col 1), the fastest with tp_col > 1 when the same space also offers tp_col in {2, 4, 8}, its
predicted speed-up over the first, and for each column degree the step's terms that differ most (tuner/plan.py column_comparison). Default constants of each cluster (no calibration); no
trial runs. AxoNN's claim to compare with: 80B on 1024 Perlmutter A100s, 26 % faster than
Megatron-LM (Singh et al. 2023, arXiv 2305.13525); its own communication-only model, re-derived,
predicts 1.35x less communication with a column axis at global batch 32 (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tuner.plan import column_comparison, fastest_fitting
from tuner.pricing import Pricing
from tuner.space import SearchSpace
from tuner.spec import load_spec, parse_spec

ROOT = Path(__file__).resolve().parent.parent

COLUMNS = [1, 2, 4, 8]
# (label, spec file, global batch override or None)
SETTINGS = [
    ("Frontier 22B, 16 GCDs, gbs 128", "studies/frontier-22b.yaml", None),
    ("Frontier 175B, 1024 GCDs, gbs 640", "studies/frontier-175b.yaml", None),
    ("Frontier 1T, 1024 GCDs, gbs 1024", "studies/frontier-1t.yaml", None),
    ("Perlmutter 80B, 1024 A100s, gbs 32", "studies/perlmutter-80b-axonn.yaml", None),
    ("Perlmutter 80B, 1024 A100s, gbs 1024", "studies/perlmutter-80b-axonn.yaml", 1024),
]


def setting(label: str, path: str, gbs: int | None) -> dict:
    raw = load_spec(ROOT / path).model_dump()
    if gbs:
        raw["training"]["global_batch_size"] = gbs
    raw["space"]["tp_col"] = COLUMNS
    spec = parse_spec(raw, path)
    rows = Pricing.for_study(spec).rank(SearchSpace.from_spec(spec).enumerate().valid)
    plain = fastest_fitting([(p, e) for p, e in rows if p.tp_col == 1])
    col = fastest_fitting([(p, e) for p, e in rows if p.tp_col > 1])
    out = {"setting": label, "spec": path, "global_batch": spec.training.global_batch_size}
    for key, pe in (("without_column", plain), ("best_column", col)):
        out[key] = None if pe is None else {
            "layout": pe[0].describe(), "tokens_per_s": pe[1].tokens_per_s, "mfu": pe[1].mfu,
        }  # fmt: skip
    if plain and col:
        out["column_speedup"] = col[1].tokens_per_s / plain[1].tokens_per_s
    out["by_column"] = column_comparison(rows)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    results = [setting(*s) for s in SETTINGS]
    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    print("| setting | best without tp_col (MFU) | best with tp_col > 1 (MFU) | predicted speed-up |")
    print("| --- | --- | --- | --- |")
    for r in results:
        a, b = r["without_column"], r["best_column"]
        cell = lambda x: f"{x['layout']} ({x['mfu']:.1%})" if x else "none fits"  # noqa: E731
        sp = f"{r['column_speedup']:.3f}x" if "column_speedup" in r else "-"
        print(f"| {r['setting']} | {cell(a)} | {cell(b)} | {sp} |")
    print()
    for r in results:
        for entry in r["by_column"]:
            print(f"{r['setting']}: tp_col {entry['tp_col']}: {entry['why']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
