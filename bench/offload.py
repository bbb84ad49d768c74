"""What activation offload (activation_checkpoint: offload, trainer/offload.py) adds to a trainer's
step on this machine's CPU, next to what the performance model prices for it (compute.offload_s).

    .venv/bin/python -m bench.offload [--model gpt-small] [--micro-batch 16] [--pairs 3]

One process, one thread (as a trial's rank runs), the trainer's own step (trainer.benchmark.run,
fp32): `--pairs` pairs of runs, none then offload, the order flipped every pair; each run's step
is the median of its measured steps. Reported: the medians over runs, their difference (what the
copies to "host" memory and back cost where host memory is the device) and the model's step for
each and its offload term, on the cpu-local cluster, uncalibrated (CPU_CONSTANTS).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from trainer.benchmark import run
from trainer.contract.parallel import ParallelConfig
from trainer.contract.result import BenchmarkConfig
from tuner.pricing import Pricing
from tuner.spec import parse_spec

MODES = ("none", "offload")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6, help="measured steps a run")
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = parse_spec({"name": "offload", "model": args.model, "cluster": "cpu-local", "num_gpus": 1,
                       "training": {"global_batch_size": args.micro_batch, "precision": "fp32"}})  # fmt: skip
    model, pricing = spec.as_model_config(), Pricing.for_study(spec)
    layouts = {
        ac: ParallelConfig(micro_batch_size=args.micro_batch, activation_checkpoint=ac) for ac in MODES
    }
    steps: dict[str, list[float]] = {ac: [] for ac in MODES}
    for pair in range(args.pairs):
        for ac in MODES if pair % 2 == 0 else reversed(MODES):
            cfg = BenchmarkConfig(model=model, parallel=layouts[ac], device="cpu", dtype="fp32", warmup_steps=2,
                                  measure_steps=args.steps)  # fmt: skip
            result = run(cfg)
            assert result.status == "ok", result.error
            steps[ac].append(statistics.median(result.step_times_s))
    measured = {ac: statistics.median(steps[ac]) for ac in MODES}
    for ac in MODES:
        est = pricing.estimate(layouts[ac])
        print(f"{ac:8s} measured {measured[ac]:.4f} s (runs {', '.join(f'{s:.4f}' for s in steps[ac])}), "
              f"predicted {est.step_time_s:.4f} s, offload term {est.terms.offload_s:.4f} s")  # fmt: skip
    added = measured["offload"] - measured["none"]
    priced = pricing.estimate(layouts["offload"]).terms.offload_s
    print(f"offload adds {added:.4f} s measured ({added / measured['none']:+.1%}), {priced:.4f} s priced")


if __name__ == "__main__":
    main()
