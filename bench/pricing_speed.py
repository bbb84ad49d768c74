"""Pricing speed and identity: every valid layout of every study in studies/ and of four large
presets priced once, timed, and every figure and term hashed, so that a change to the cost model
shows both its speed (compare runs side by side) and whether any estimate moved (the hash).

    .venv/bin/python -m bench.pricing_speed
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

from tuner.pricing import Pricing
from tuner.space import SearchSpace
from tuner.spec import StudySpec, load_spec, parse_spec

ROOT = Path(__file__).resolve().parents[1]
# (model, cluster preset, GPUs, global batch): mixtures of experts, a 70B and a 175B beside the studies
PRESETS = [("mixtral-8x7b", "h100-80gb", 64, 256), ("qwen3-30b-a3b", "h100-80gb", 16, 128),
           ("llama3.1-70b", "h100-80gb", 64, 256), ("gpt-175b", "a100-80gb", 512, 1536)]  # fmt: skip


def _preset(model: str, cluster: str, gpus: int, batch: int) -> StudySpec:
    return parse_spec({"name": model, "model": model, "cluster": {"preset": cluster, "num_nodes": gpus // 8},
                       "num_gpus": gpus, "training": {"global_batch_size": batch}})  # fmt: skip


def specs() -> list[StudySpec]:
    out = [load_spec(p) for p in sorted((ROOT / "studies").glob("*.yaml"))]
    return out + [_preset(*row) for row in PRESETS]


def main() -> None:
    digest, count, priced_s = hashlib.sha256(), 0, 0.0
    for spec in specs():
        valid = SearchSpace.from_spec(spec).enumerate().valid
        pricing = Pricing.for_study(spec)
        t0 = time.process_time()
        estimates = [pricing.estimate(c) for c in valid]
        priced_s += time.process_time() - t0
        for c, e in zip(valid, estimates, strict=True):
            figures = (e.memory_bytes, e.step_time_s, e.tokens_per_s, e.fits, e.terms.as_dict())
            digest.update(repr((c.to_dict(), *figures)).encode())
        count += len(valid)
    print(
        f"{count} layouts priced in {priced_s:.1f} s of CPU ({priced_s / count * 1e3:.2f} ms each); "
        f"sha256 of every figure and term {digest.hexdigest()}"
    )


if __name__ == "__main__":
    main()
