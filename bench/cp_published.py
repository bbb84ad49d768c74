"""Published long-context (context-parallel) training runs on H100 priced by the performance model,
next to their measured throughput, uncalibrated; and what the planner picks for the same study
(same model, sequence, GPUs and global batch; the space searches cp).

    .venv/bin/python -m bench.cp_published

Published:
- torchtitan (pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, docs/performance.md
  until d4c86e3 of 2025-01-30; runs of 2024-12 with torch 1963fc8, torchtitan 9dec370), "Grand
  Teton" hosts of 8 H100 with NVLink, 96 GB HBM2e, 400 Gb/s RDMA per GPU, 500 W; TPS/GPU at step
  90, memory the fullest GPU's. Table 2: Llama 3.1 8B on 8 GPUs, FSDP + CP + compile + Float8,
  local batch 1, full AC: FSDP 8 CP 1 at 32,768 tokens 3,890 TPS/GPU (83.9 GiB); FSDP 4 CP 2 at
  65,536 2,540 (84.2); FSDP 2 CP 4 at 131,072 1,071 (84.0); FSDP 1 CP 8 at 262,144 548 (84.5).
  Table 6: Llama 3.1 405B on 512 GPUs, TP 8 x PP 8 (1F1B) x FSDP x CP, compile + Float8 + async
  TP, local batch 8, full AC: FSDP 8 CP 1 at 32,768 76 TPS/GPU (75.3 GiB); FSDP 4 CP 2 at 65,536
  47 (75.9); FSDP 2 CP 4 at 131,072 31 (77.1); FSDP 1 CP 8 at 262,144 16 (84.9).
  Their CP is torch's experimental context_parallel (torch.distributed.tensor.experimental): K/V
  all-gathered by default (_RotateMethod.ALL_GATHER), head-tail load balancing, and SDPA called per
  K/V block with is_causal / full / skipped, so masked blocks cost nothing.
- Llama 3 (Meta), the 405B's long-context stage: 16,384 H100 (80 GB HBM3, 700 W), TP 8, CP 16,
  PP 16 (DP 8 by division), 16M tokens a batch, 380 TFLOP/s per GPU (BF16); read from Pavan
  Balaji's SC'24 slide as transcribed at https://glennklockwood.com/garden/llama-3.1 (the paper,
  arXiv 2407.21783 Table 4, has the same rows; not read here). The CP 16 row is the 128k stage:
  131,072 tokens, so 128 sequences a batch (16 x 2^20 / 131,072), 16 per DP rank. Their CP
  all-gathers K/V before attention (the "all-gather based pass-KV ... used in Llama3 training" of
  PyTorch's context-parallel tutorial, pytorch/tutorials prototype_source/context_parallel.rst),
  as ours does (their attention kernel is not described there); their pipeline is a tuned
  interleaved schedule with uneven stages (126 layers): priced as plain 1F1B over pp 16 with one
  micro-batch a sequence, ZeRO-2-like FSDP (they keep the gathered weights between passes), no
  recompute (unknown).
- NVIDIA NeMo 24.07 performance summary (NVIDIA/NeMo docs/source/performance/performance_summary.md
  at 070a0bb), DGX-H100, FP8, CP at 8,192 tokens: Llama 3 8B on 8 GPUs (GBS 128, MBS 1, TP 1 PP 1
  CP 2) 12,036 tokens/s/GPU; Llama 3 70B on 64 GPUs (GBS 128, MBS 1, TP 4 PP 4 CP 2 VP 5) 1,533.
- Megatron-Bridge performance summary archive (NVIDIA-NeMo/Megatron-Bridge
  docs/performance-summary-archive.md at 067f987), "25.11 NeMo Container", DGX-H100, FP8-CS: Llama
  3.1 405B on 1024 GPUs (GBS 512, MBS 1, 8,192 tokens, TP 8 PP 8 CP 2 VP 8, DDP) 292 tokens/s/GPU.
  Megatron's CP (NVIDIA/Megatron-LM docs/source/api-guide/context_parallel.rst at 1df56dc): the
  K/V all-gather and reduce-scatter run as point-to-point sends in a ring, the computation the
  causal mask makes unnecessary is removed, and each GPU keeps only its own chunk's K/V for
  backward (gathering again there).
Like with like: the model prices our trainer in bf16 with eager kernels, whose CP all-gathers K/V
with nothing overlapped and passes an explicit mask that no kernel skips (docs/perfmodel.md
"Context parallelism"); Float8 / FP8 rows are shown with that caveat. Megatron's data parallelism
(distributed optimizer) is priced as ZeRO-2 over dp, torchtitan's FSDP as ZeRO-3 over dp x cp.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from bench.moe_published import exports_cell
from trainer.contract.parallel import ParallelConfig
from tuner.cost.terms import Estimate
from tuner.plan import fastest_fitting
from tuner.pricing import Pricing
from tuner.space import SearchSpace
from tuner.spec import StudySpec, parse_spec

TPS, TFLOPS = "tokens/s/GPU", "TFLOP/s/GPU"


@dataclass(frozen=True)
class Run:
    source: str
    preset: str
    seq_len: int
    gpus: int
    global_batch: int
    layout: ParallelConfig
    published: float  # in `unit`
    unit: str
    stack: str  # what the published figure ran with
    memory_gib: float | None = None  # published peak memory (the fullest GPU), where given
    device_memory_gb: float | None = None  # None: the h100-80gb preset's (nvidia-smi's 85.5e9 B)
    mapped: str = ""  # how their layout differs from the one priced
    # The recipe's recompute is not published: priced at the fastest checkpointing that fits
    recompute_unknown: bool = False


def _torchtitan(fsdp: int, cp: int, local_batch: int, tp: int = 1, pp: int = 1) -> ParallelConfig:
    """FSDP2 over dp_shard x cp, full AC; with pp, torchtitan's local batch is cut into
    micro-batches of 1 (its default pipeline micro-batch size)."""
    mbs, microbatches = (1, local_batch) if pp > 1 else (local_batch, 1)
    return ParallelConfig(tp=tp, pp=pp, dp_shard=fsdp, cp=cp, zero_stage=3, micro_batch_size=mbs,
                          num_microbatches=microbatches, activation_checkpoint="full",
                          sequence_parallel=tp > 1)  # fmt: skip


def _megatron(gpus: int, gbs: int, tp: int, pp: int, cp: int, vp: int = 1) -> ParallelConfig:
    """Megatron's DDP with the distributed optimizer (~ our ZeRO-2 over dp), TP + SP, micro-batch 1."""
    dp = gpus // (tp * pp * cp)
    return ParallelConfig(tp=tp, pp=pp, dp_shard=dp, cp=cp, zero_stage=2 if dp > 1 else 0, micro_batch_size=1,
                          num_microbatches=gbs // dp, sequence_parallel=tp > 1,
                          pp_schedule="interleaved_1f1b" if vp > 1 else "1f1b", virtual_stages=vp)  # fmt: skip


TITAN2 = "torchtitan Table 2"
TITAN6 = "torchtitan Table 6"
F8 = "compile + Float8"
F8_TP = "compile + Float8 + async TP, 1F1B"
RUNS = (
    Run(TITAN2, "llama3.1-8b", 32768, 8, 8, _torchtitan(8, 1, 1), 3890, TPS, F8, 83.9, 96),
    Run(TITAN2, "llama3.1-8b", 65536, 8, 4, _torchtitan(4, 2, 1), 2540, TPS, F8, 84.2, 96),
    Run(TITAN2, "llama3.1-8b", 131072, 8, 2, _torchtitan(2, 4, 1), 1071, TPS, F8, 84.0, 96),
    Run(TITAN2, "llama3.1-8b", 262144, 8, 1, _torchtitan(1, 8, 1), 548, TPS, F8, 84.5, 96),
    Run(TITAN6, "llama3.1-405b", 32768, 512, 64, _torchtitan(8, 1, 8, tp=8, pp=8), 76, TPS, F8_TP, 75.3, 96),
    Run(TITAN6, "llama3.1-405b", 65536, 512, 32, _torchtitan(4, 2, 8, tp=8, pp=8), 47, TPS, F8_TP, 75.9, 96),
    Run(TITAN6, "llama3.1-405b", 131072, 512, 16, _torchtitan(2, 4, 8, tp=8, pp=8), 31, TPS, F8_TP, 77.1, 96),
    Run(TITAN6, "llama3.1-405b", 262144, 512, 8, _torchtitan(1, 8, 8, tp=8, pp=8), 16, TPS, F8_TP, 84.9, 96),
    Run("Llama 3 (SC'24 slide), 128k stage", "llama3.1-405b", 131072, 16384, 128,
        ParallelConfig(tp=8, pp=16, dp_shard=8, cp=16, zero_stage=2, micro_batch_size=1, num_microbatches=16,
                       sequence_parallel=True), 380, TFLOPS, "BF16",
        mapped="their tuned interleaved schedule (126 layers, uneven stages) priced as 1F1B",
        recompute_unknown=True),
    Run("NeMo 24.07 perf summary", "llama3.1-8b", 8192, 8, 128, _megatron(8, 128, 1, 1, 2), 12036, TPS, "FP8"),
    Run("NeMo 24.07 perf summary", "llama3.1-70b", 8192, 64, 128, _megatron(64, 128, 4, 4, 2, 5), 1533, TPS, "FP8"),
    Run("Megatron-Bridge 25.11", "llama3.1-405b", 8192, 1024, 512, _megatron(1024, 512, 8, 8, 2, 8), 292, TPS,
        "FP8-CS", mapped="126 layers over 64 virtual stages (uneven)"),
)  # fmt: skip


def study(run: Run) -> StudySpec:
    return parse_spec({
        "name": f"published-cp-{run.preset}", "model": run.preset, "num_gpus": run.gpus,
        "cluster": {"preset": "h100-80gb", "num_nodes": run.gpus // 8,
                    **({"device_memory_gb": run.device_memory_gb} if run.device_memory_gb else {})},
        "training": {"global_batch_size": run.global_batch, "seq_len": run.seq_len, "precision": "bf16"},
        "space": {"tp": [1, 2, 4, 8], "pp": [1, 2, 4, 8, 16], "micro_batch_size": [1, 2, 4],
                  "zero_stage": [0, 2, 3], "activation_checkpoint": ["none", "selective", "full", "offload"]},
    })  # fmt: skip


def metric(est: Estimate, run: Run) -> float:
    return est.tflops_per_device if run.unit == TFLOPS else est.tokens_per_s / run.gpus


def priced_layout(run: Run, pricing: Pricing) -> ParallelConfig:
    """The row's layout as priced: where its recompute is not published, the fastest of the
    checkpointing modes that fits (else none)."""
    if not run.recompute_unknown:
        return run.layout
    modes = [
        dataclasses.replace(run.layout, activation_checkpoint=ac)
        for ac in ("none", "selective", "full", "offload")
    ]
    fitting = [
        (pricing.estimate(m).step_time_s, i, m) for i, m in enumerate(modes) if pricing.estimate(m).fits
    ]
    return min(fitting)[2] if fitting else run.layout


def row(run: Run) -> str:
    spec = study(run)
    pricing = Pricing.for_study(spec)
    layout = priced_layout(run, pricing)
    unknown = (
        f"recompute unknown: the fastest that fits, {layout.activation_checkpoint}"
        if run.recompute_unknown
        else ""
    )
    est = pricing.estimate(layout)
    predicted = metric(est, run)
    # Priced even where our rules refuse the layout, with the rule named (a gap to report).
    refused = layout.problems(spec.as_model_config())
    notes = [n for n in (run.mapped, unknown, *(f"our rules refuse: {r}" for r in refused)) if n]
    note = f" ({'; '.join(notes)})" if notes else ""
    ranked = pricing.rank(SearchSpace.from_spec(spec).enumerate().valid)
    best = fastest_fitting(ranked)
    pick = best[0].describe() if best else "none fits"
    pick_metric = f"{metric(best[1], run):,.0f}" if best else ""
    pick_cp = str(best[0].cp) if best else ""
    pick_exports = exports_cell(spec, ranked, run.gpus)
    published_gib = f"{run.memory_gib:.1f}" if run.memory_gib else "n/a"
    return (f"| {run.source} | {run.preset} | {run.seq_len:,} | {run.gpus:,} | {run.global_batch} "
            f"| {layout.describe()}{note} | {run.published:,.0f} {run.unit} ({run.stack}) | {predicted:,.0f} "
            f"| {predicted / run.published:.2f} | {published_gib} | {est.memory_bytes / 2**30:.1f} "
            f"| {'yes' if est.fits else 'no'} | {pick} | {pick_metric} | {pick_cp} | {pick_exports} |")  # fmt: skip


def main() -> None:
    print(
        "| source | model | seq | GPUs | global batch | layout priced | published | predicted | predicted / published |"
        " published GiB | predicted GiB | fits | planner's pick | its predicted | its cp | its exports |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for run in RUNS:
        print(row(run), flush=True)


if __name__ == "__main__":
    main()
