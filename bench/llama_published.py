"""Published Llama 3.1 training runs on H100 priced by the performance model, next to their
measured throughput, uncalibrated; and what the planner picks for the same study.

    .venv/bin/python -m bench.llama_published

Published: torchtitan's docs/performance.md (pytorch/torchtitan at eaea6f6, runs of 2024-12 with
torchtitan 9dec370), "Grand Teton" hosts of 8 H100 with NVLink, 96 GB HBM2e at 2.4 TB/s, 400 Gb/s
RDMA per GPU, a 500 W power limit (their footnote: the real peak is between the SXM's and the NVL's;
they divide by the SXM's). Throughput is tokens per second per GPU (TPS/GPU) at the 90th step.
- Table 1: Llama 3.1 8B on 8 GPUs, FSDP 8, local batch 2 (global 16), sequence 8192, selective
  activation checkpointing: 5,762 TPS/GPU (eager), 6,667 (torch.compile), 8,532 (+ Float8).
- Table 3: the same on 128 GPUs (global batch 256): 5,605 / 6,514 / 8,380.
- Table 4: Llama 3.1 70B on 256 GPUs, FSDP 32 x TP 8, local batch 16 (global 512), full AC,
  compile + Float8: 829 TPS/GPU (876 with async TP).
- Table 5: Llama 3.1 405B on 512 GPUs, FSDP 8 x TP 8 x PP 8, local batch 32 (global 256), full AC,
  compile + Float8 + async TP: 1F1B 100, interleaved 1F1B 128 TPS/GPU.
Like with like: the model prices bf16 (no Float8) and eager kernels; the bf16 eager rows are the
comparable ones (Tables 1 and 3); the Float8 rows are shown with that caveat (Float8 gained 1.28x
over bf16 compile on 8B: Table 1). torchtitan's "selective op" (every other matmul's output and the
attention's kept, the rest recomputed) is our activation_checkpoint "op" (trainer/parallelize.py:
its policy), priced as such; our "selective" (the attention core) is a different one. Micro-batch: torchtitan's local batch is the micro-batch without pipelining (no gradient
accumulation); with pipelining its local batch is cut into micro-batches of 1 (its default
pipeline micro-batch size), 32 for the 405B run.
Cluster: tuner/hardware.py's h100-80gb preset with 96 GB per GPU (their HBM2e part); the H100
SXM's peak and bandwidth (devicelevels): so the prediction is expected optimistic (their part is
slower).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.contract.parallel import ParallelConfig
from tuner.plan import fastest_fitting
from tuner.pricing import Pricing
from tuner.space import SearchSpace
from tuner.spec import StudySpec, parse_spec


@dataclass(frozen=True)
class Run:
    table: str
    preset: str
    gpus: int
    global_batch: int
    layout: ParallelConfig
    published: float  # TPS/GPU
    memory_gib: float  # published peak memory (GiB, the fullest GPU)
    stack: str  # what the published figure ran with


def _fsdp(dp: int, mbs: int, ac: str, tp: int = 1, pp: int = 1, microbatches: int = 1,
          schedule: str = "1f1b", virtual: int = 1) -> ParallelConfig:  # fmt: skip
    # torchtitan's tensor parallel plan always shards the norms' and the residual's sequence (SP).
    return ParallelConfig(tp=tp, pp=pp, dp_shard=dp, zero_stage=3, micro_batch_size=mbs, num_microbatches=microbatches,
                          activation_checkpoint=ac, sequence_parallel=tp > 1, pp_schedule=schedule,
                          virtual_stages=virtual)  # fmt: skip


RUNS = (
    Run("1", "llama3.1-8b", 8, 16, _fsdp(8, 2, "op"), 5762, 82.4, "bf16 eager"),
    Run("1", "llama3.1-8b", 8, 16, _fsdp(8, 2, "op"), 6667, 77.0, "bf16 + compile"),
    Run("3", "llama3.1-8b", 128, 256, _fsdp(128, 2, "op"), 5605, 67.0, "bf16 eager"),
    Run("3", "llama3.1-8b", 128, 256, _fsdp(128, 2, "op"), 6514, 62.0, "bf16 + compile"),
    Run("4", "llama3.1-70b", 256, 512, _fsdp(32, 16, "full", tp=8), 829, 71.9, "compile + Float8"),
    Run("5", "llama3.1-405b", 512, 256, _fsdp(8, 1, "full", tp=8, pp=8, microbatches=32), 100, 82.5,
        "compile + Float8 + async TP, 1F1B"),
    Run("5", "llama3.1-405b", 512, 256, _fsdp(8, 1, "full", tp=8, pp=8, microbatches=32, schedule="interleaved_1f1b",
                                           virtual=2), 128, 72.7, "compile + Float8 + async TP, interleaved 1F1B"),
)  # fmt: skip


def study(run: Run) -> StudySpec:
    return parse_spec({
        "name": f"torchtitan-{run.preset}", "model": run.preset, "num_gpus": run.gpus,
        "cluster": {"preset": "h100-80gb", "num_nodes": run.gpus // 8, "device_memory_gb": 96},
        "training": {"global_batch_size": run.global_batch, "precision": "bf16"},
        "space": {"tp": [1, 2, 4, 8], "pp": [1, 2, 4, 8, 16], "micro_batch_size": [1, 2, 4],
                  "zero_stage": [0, 2, 3], "activation_checkpoint": ["none", "selective", "op", "full"]},
    })  # fmt: skip


def main() -> None:
    print(
        "| table | model | GPUs | layout | published TPS/GPU (stack) | predicted TPS/GPU | predicted / published |"
        " predicted MFU | published memory GiB | predicted GiB | fits | planner's pick | its predicted TPS/GPU |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for run in RUNS:
        spec = study(run)
        pricing = Pricing.for_study(spec)
        problems = run.layout.problems(spec.as_model_config())
        if problems:
            raise SystemExit(f"{run.preset} {run.layout.describe()}: {problems}")
        est = pricing.estimate(run.layout)
        tps = est.tokens_per_s / run.gpus
        best = fastest_fitting(pricing.rank(SearchSpace.from_spec(spec).enumerate().valid))
        pick = f"{best[0].describe()}" if best else "none fits"
        pick_tps = f"{best[1].tokens_per_s / run.gpus:,.0f}" if best else ""
        print(f"| {run.table} | {run.preset} | {run.gpus} | {run.layout.describe()} | {run.published:,.0f} ({run.stack}) "
              f"| {tps:,.0f} | {tps / run.published:.2f} | {est.mfu:.1%} | {run.memory_gib:.1f} | {est.memory_bytes / 2**30:.1f} "
              f"| {'yes' if est.fits else 'no'} "
              f"| {pick} | {pick_tps} |")  # fmt: skip


if __name__ == "__main__":
    main()
