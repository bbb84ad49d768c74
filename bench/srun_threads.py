"""Threads per rank under srun, side by side: a few gpt-small layouts of 8 ranks on the local
4-node Slurm cluster (2 ranks per node, all sharing this machine's cores), each run with
OMP_NUM_THREADS set to each of `--threads` in turn, alternating, `--repeats` times.

    flock /tmp/parallel-tuner-measure.lock .venv/bin/python -m bench.srun_threads --threads 2 1

`--threads 2` on this 2-core VM is what every srun rank ran with before trainer/benchmark.py's
`slurm_threads` (torch's default: a thread per core); `1` is what the rule now gives two ranks on a
node. Prints each run's median measured step time and the thread count the trial reports.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from bench.measure_table import slurm_runner
from trainer.contract.parallel import ParallelConfig
from trainer.contract.presets import MODEL_PRESETS
from trainer.contract.result import BenchmarkConfig

P = ParallelConfig
LAYOUTS = {  # from data parallel only to a pipeline across all 4 nodes with tp inside each
    "dp8 mbs2x1": P(dp_replicate=8, micro_batch_size=2),
    "pp2 dp4 mbs2x2": P(pp=2, dp_replicate=4, micro_batch_size=2, num_microbatches=2),
    "pp4 dp2 mbs2x4": P(pp=4, dp_replicate=2, micro_batch_size=2, num_microbatches=4),
    "tp2 dp4 mbs2x2": P(tp=2, dp_replicate=4, micro_batch_size=2, num_microbatches=2),
    "tp2 pp4 mbs1x16": P(tp=2, pp=4, micro_batch_size=1, num_microbatches=16),
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--inter-node-mbit", type=int, help="shape links between nodes")
    args = parser.parse_args()
    model = MODEL_PRESETS["gpt-small"]
    with tempfile.TemporaryDirectory() as tmp, slurm_runner(4, args.inter_node_mbit) as run:
        for repeat in range(args.repeats):
            for threads in args.threads:
                os.environ["OMP_NUM_THREADS"] = str(threads)  # sbatch exports the submitter's environment
                for name, layout in LAYOUTS.items():
                    cfg = BenchmarkConfig(
                        model=model, parallel=layout, warmup_steps=2, measure_steps=3, device="cpu"
                    )
                    result = run(cfg, Path(tmp) / f"{repeat}-{threads}-{name.replace(' ', '_')}")
                    step = statistics.median(result.step_times_s) if result.step_times_s else float("nan")
                    print(f"repeat {repeat} OMP_NUM_THREADS={threads} {name:16s} {result.status:6s} "
                          f"{step:7.3f} s/step  ({result.device_name})", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
