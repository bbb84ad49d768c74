"""The demo's regime: gpt-tiny on 2 gloo ranks on this machine's 2 cores (one rank per core), a
few layouts measured at steady state against the CPU defaults' prediction.

    .venv/bin/python -m bench.one_rank_per_core [--warmup-steps 3] [--measure-steps 8]

The CPU defaults are fitted on tables of 8 ranks on 2 cores (tuner/perfconstants.py); this prints
how far they are from one rank per core (docs/benchmarks.md, "One rank per core").
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from trainer.contract.parallel import ParallelConfig
from trainer.contract.presets import MODEL_PRESETS
from trainer.contract.result import BenchmarkConfig
from trainer.launch import run_local
from tuner.hardware import cluster_preset
from tuner.perfconstants import CPU_CONSTANTS
from tuner.perfmodel import estimate
from tuner.spec import ClusterSpec

LAYOUTS = (
    ParallelConfig(tp=1, dp_replicate=2, micro_batch_size=4, num_microbatches=1),
    ParallelConfig(tp=2, micro_batch_size=8, num_microbatches=1),
    ParallelConfig(tp=2, micro_batch_size=8, num_microbatches=1, activation_checkpoint="full"),
    ParallelConfig(tp=2, micro_batch_size=4, num_microbatches=2),
    ParallelConfig(pp=2, micro_batch_size=4, num_microbatches=2),
)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--measure-steps", type=int, default=8)
    args = parser.parse_args()
    model = MODEL_PRESETS["gpt-tiny"]
    cluster = ClusterSpec(**{**cluster_preset("cpu-local"), "gpus_per_node": 2, "cores_per_node": 2.0})
    print("| layout | measured median s (min-max) | predicted s | measured / predicted |")
    print("| --- | --- | --- | --- |")
    for p in LAYOUTS:
        cfg = BenchmarkConfig(model=model, parallel=p, warmup_steps=args.warmup_steps,
                              measure_steps=args.measure_steps, device="cpu")  # fmt: skip
        with tempfile.TemporaryDirectory() as d:
            r = run_local(cfg, Path(d), timeout_s=300)
        if not r.ok:
            print(f"| {p.describe()} | {r.status} | | |", flush=True)
            continue
        t = statistics.median(r.step_times_s)
        pred = estimate(model, p, cluster, "fp32", CPU_CONSTANTS).step_time_s
        print(f"| {p.describe()} | {t:.3f} ({min(r.step_times_s):.3f}-{max(r.step_times_s):.3f}) | {pred:.3f} "
              f"| {t / pred:.1f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
