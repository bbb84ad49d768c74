"""Golden predictions over every study in studies/ and every model preset: a sample of each one's
valid layouts (every STRIDE-th, the first and the last), priced by the model; the test
(test_pricing.py) prices them again and wants every figure to the last bit. Written from the
code before the house was rebuilt around the axis table (issue 36: commit 5971743), so that a
refactor of the cost model shows as a diff here, and a deliberate change is re-recorded with its
reason in the commit.

    PYTHONPATH=<checkout> .venv/bin/python -m tests.tuner.golden_predictions --write   # record
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from tuner.pricing import Pricing
from tuner.space import SearchSpace
from tuner.spec import StudySpec, load_spec, parse_spec

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "golden" / "predictions.json"
STRIDE = 97  # a prime: the sample walks through every knob's values
FIGURES = ("step_time_s", "memory_bytes", "tokens_per_s", "mfu", "fits")


def _preset_spec(name: str) -> StudySpec:
    """A preset on 64 H100-80GB (8 nodes) at a global batch of 256 sequences, the default space;
    the CPU shapes on the local CPU cluster's 2 ranks."""
    from trainer.config import MODEL_PRESETS  # the one import both sides of the refactor have

    tiny = MODEL_PRESETS[name].num_params < 50_000_000
    cluster = "cpu-local" if tiny else {"preset": "h100-80gb", "num_nodes": 8}
    return parse_spec({"name": name, "model": name, "cluster": cluster, "num_gpus": 2 if tiny else 64,
                       "training": {"global_batch_size": 8 if tiny else 256}})  # fmt: skip


def cases() -> dict[str, StudySpec]:
    from trainer.config import MODEL_PRESETS

    out = {f"studies/{p.name}": load_spec(p) for p in sorted((ROOT / "studies").glob("*.yaml"))}
    out |= {f"preset/{name}": _preset_spec(name) for name in sorted(MODEL_PRESETS)}
    return out


def figures(pricing: Pricing, config) -> dict[str, Any]:
    est = pricing.estimate(config)
    return {**{k: getattr(est, k) for k in FIGURES}, "terms": est.terms.as_dict()}


def record() -> list[dict[str, Any]]:
    rows = []
    for case, spec in cases().items():
        valid = SearchSpace.from_spec(spec).enumerate().valid
        pricing = Pricing.for_study(spec)
        picked = sorted({0, len(valid) - 1, *range(0, len(valid), STRIDE)}) if valid else []
        for i in picked:
            rows.append({"case": case, "config": valid[i].to_dict(), **figures(pricing, valid[i])})
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"record {GOLDEN.relative_to(ROOT)}")
    args = parser.parse_args()
    rows = record()
    if args.write:
        GOLDEN.write_text(json.dumps(rows, indent=0, sort_keys=True) + "\n")
    print(f"{len(rows)} rows over {len({r['case'] for r in rows})} cases")
