"""Proposal latency of each sampler with N finished trials in the study.

    .venv/bin/python -m bench.sampler_latency [--trials 1000] [--asks 20] [--samplers model,tpe,...]

The space: gpt-22b on 1024 A100s (thousands of valid layouts). The first N layouts a random
sampler proposes are told as finished trials (the performance model with other constants is
the 'measurement'); then we time `asks` ask() calls, each followed by its tell(). Target for
`model`: < 100 ms per ask at 1000 finished trials.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from tuner.outcome import Outcome
from tuner.perfconstants import ModelConstants
from tuner.pricing import Pricing
from tuner.samplers import SAMPLERS, make_sampler
from tuner.space import SearchSpace
from tuner.spec import parse_spec

TRUTH = ModelConstants(compute_efficiency=0.45, comm_efficiency=0.6)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=1000)
    parser.add_argument("--asks", type=int, default=20)
    parser.add_argument("--samplers", default=",".join(SAMPLERS))
    args = parser.parse_args()
    spec = parse_spec({"model": "gpt-22b", "cluster": {"preset": "a100-80gb", "num_nodes": 128},
                       "training": {"global_batch_size": 1024},
                       "space": {"tp": [1, 2, 4, 8], "pp": [1, 2, 4, 8, 16], "micro_batch_size": [1, 2, 4, 8],
                                 "virtual_stages": [2, 3, 4, 6]}})  # fmt: skip
    truth = Pricing.for_study(spec, TRUTH)
    valid = SearchSpace.from_spec(spec).enumerate().valid
    print(f"space: {len(valid)} valid layouts; {args.trials} finished trials; {args.asks} timed asks")

    def measure(c) -> Outcome:
        e = truth.estimate(c)
        return Outcome(ok=True, tokens_per_s=e.tokens_per_s, step_time_s=e.step_time_s)

    history = random.Random(0).sample(valid, args.trials)
    for name in args.samplers.split(","):
        sampler = make_sampler(name, valid, seed=0, pricing=Pricing.for_study(spec))
        t0 = time.perf_counter()
        for c in history:
            sampler.replay(c, measure(c))
        replay_s = time.perf_counter() - t0
        times = []
        for _ in range(args.asks):
            t0 = time.perf_counter()
            c = sampler.ask()
            times.append(time.perf_counter() - t0)
            sampler.tell(c, measure(c))
        print(f"{name:>7}: ask median {statistics.median(times) * 1e3:8.1f} ms, max {max(times) * 1e3:8.1f} ms "
              f"(replaying {args.trials} trials took {replay_s:.1f} s)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
