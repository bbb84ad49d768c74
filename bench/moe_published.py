"""Published mixture-of-experts training runs on H100 priced by the performance model, next to
their measured throughput, uncalibrated; and what the planner picks for the same study.

    .venv/bin/python -m bench.moe_published [--terms]

--terms adds a second table: each published layout's predicted step split into the model's terms
(seconds and share), next to the published step (global batch tokens / (published tokens/s/GPU x
GPUs)): what the difference is made of, and which of those terms a framework hides or shrinks
that our trainer does not (named in docs/benchmarks.md).

Published (H100 SXM 80 GB, 8 per node with NVLink 4, InfiniBand 8 x 400 Gb/s; sequence 4096):
- NVIDIA's Megatron-Bridge performance summary (docs/performance-summary.md of
  NVIDIA-NeMo/Megatron-Bridge, "25.09 NeMo Container", System DGX-H100; and "25.11", FP8-CS rows):
  Qwen3-30B-A3B on 16 GPUs (global batch 512, micro-batch 2, PP 2 x VP 24, EP 8) 10,494 tokens/s/GPU
  (25.09, token-drop), 5,275 (25.11, FP8-CS, dropless and force-balanced: their footnote);
  Qwen3-235B-A22B on 256 GPUs (global batch 2048, micro-batch 1, TP 2, PP 8 x VP 4, EP 32) 1,204
  (25.09, token-drop), 1,575 (25.11, FP8-CS); DeepSeek-V3 on 1024 GPUs (global batch 8192, TP 2,
  PP 8 x VP 4, EP 64, dropless, force-balanced, FP8) 1,297.
  The 25.09 tables have no precision column; their figures are FP8: the footnote under them reads
  the figures in parentheses as quantization granularities (128 x 128 weights and 1 x 128
  activations on H100, DeepSeek-V3's FP8 recipe), Llama 3 8B's H100 row in the same table runs
  725 TFLOP/s per GPU (73 % of the H100's dense BF16 peak, 37 % of its FP8 one) and 25.11 labels
  the same Qwen3-235B layout FP8-CS; Bridge's Qwen3-30B H100 configs run micro-batch 2 in FP8 and
  1 in BF16 (scripts/performance/configs/qwen3/qwen3_30b_a3b_llm_pretrain.py). So every Bridge
  row here is an FP8 figure, priced in bf16 with that caveat (issue 38 prices FP8); the model
  zoo's Qwen3-235B row is the one BF16 figure.
- Megatron-Core's MoE model zoo (yanring/Megatron-MoE-ModelZoo best_practice/Qwen3/readme.md):
  Qwen3-235B-A22B on 256 H100 in BF16 with the plain all-to-all dispatcher (ours too, no DeepEP):
  TP 2, EP 8, PP 32 x VP 3, DP 4, micro-batch 1, global batch 2048, recompute of norms and
  activations: 24.2 s per step = 1,354 tokens/s/GPU (200 TFLOP/s per GPU as they count).
Like with like: the model prices bf16 eager kernels, each row at its routing: force-balanced rows
with balanced routing (imbalance 1), token-drop rows at capacity factor 1
(training.moe_capacity_factor: no expert computes past its mean share; until issue 37 they were
priced dropless at the default imbalance 1.3, and so was every row), the model zoo's dropless
learned routing at the default imbalance 1.3; FP8 rows are shown with that caveat. Layouts our trainer cannot express are mapped to the nearest one and
said so: Megatron's uneven pipeline layouts (94 layers over 96 virtual stages). Its per-module
recompute ("norm, act") is our layernorm+moe_act (with pp > 1 since issue 37).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.contract.parallel import ParallelConfig
from tuner.exports import refusals
from tuner.plan import fastest_fitting
from tuner.pricing import Pricing, Ranked
from tuner.space import SearchSpace
from tuner.spec import StudySpec, parse_spec


@dataclass(frozen=True)
class Run:
    source: str
    preset: str
    gpus: int
    global_batch: int
    layout: ParallelConfig
    published: float  # tokens/s per GPU
    stack: str  # what the published figure ran with
    mapped: str = ""  # how their layout differs from the one priced
    training: tuple[tuple[str, object], ...] = ()  # the study's training fields for its routing


DROP = (("moe_capacity_factor", 1.0),)  # token-drop rows: Megatron-Bridge's apply_moe_token_drop
BALANCED = (("moe_routing", "balanced"),)  # force-balanced, dropless rows
# Megatron-Bridge's Qwen3 performance configs set grad_reduce_in_fp32 false (bf16 gradients;
# scripts/performance/configs/qwen3/*.py); DeepSeek-V3's and the model zoo's are not checked: fp32.
BF16_GRADS = (("grad_reduce_dtype", "bf16"),)


def _megatron(
    gpus: int, gbs: int, mbs: int, tp: int, pp: int, vp: int, ep: int, ac: str = "none"
) -> ParallelConfig:
    """Megatron's DP (replicated weights, distributed optimizer ~ our zero 2 over dp) with its
    TP + SP, interleaved pipeline and EP folded into DP x TP."""
    dp = gpus // (tp * pp)
    microbatches = gbs // (mbs * dp)
    schedule = "interleaved_1f1b" if vp > 1 else "1f1b"
    return ParallelConfig(tp=tp, pp=pp, dp_shard=dp, zero_stage=2 if dp > 1 else 0, micro_batch_size=mbs,
                          num_microbatches=microbatches, activation_checkpoint=ac, sequence_parallel=tp > 1,
                          pp_schedule=schedule, virtual_stages=vp, ep=ep)  # fmt: skip


BRIDGE = "Megatron-Bridge perf summary, DGX-H100"
ZOO = "Megatron MoE model zoo, Qwen3"
RUNS = (
    Run(BRIDGE + " 25.09", "qwen3-30b-a3b", 16, 512, _megatron(16, 512, 2, 1, 2, 24, 8), 10494, "FP8, token-drop",
        training=DROP + BF16_GRADS),
    Run(BRIDGE + " 25.11", "qwen3-30b-a3b", 16, 512, _megatron(16, 512, 2, 1, 2, 24, 8), 5275,
        "FP8-CS, dropless, force-balanced", training=BALANCED + BF16_GRADS),
    Run(BRIDGE + " 25.09", "qwen3-235b-a22b", 256, 2048, _megatron(256, 2048, 1, 2, 8, 4, 32), 1204,
        "FP8, token-drop", "94 layers over 32 virtual stages: uneven in Megatron, ours needs 2-3 layers a stage",
        training=DROP + BF16_GRADS),
    Run(BRIDGE + " 25.11", "qwen3-235b-a22b", 256, 2048, _megatron(256, 2048, 1, 2, 8, 4, 32), 1575,
        "FP8-CS, dropless, force-balanced", training=BALANCED + BF16_GRADS),
    Run(ZOO, "qwen3-235b-a22b", 256, 2048, _megatron(256, 2048, 1, 2, 32, 1, 8, "layernorm+moe_act"), 1354,
        "BF16, all-to-all dispatcher, recompute norm+act", "PP 32 x VP 3 (uneven) priced as PP 32 x VP 1"),
    Run(BRIDGE + " 25.09", "deepseek-v3", 1024, 8192, _megatron(1024, 8192, 1, 2, 8, 4, 64), 1297,
        "FP8, dropless, force-balanced, MTP layer", "61 layers over 32 virtual stages (uneven in Megatron)",
        training=BALANCED),
)  # fmt: skip


def study(run: Run) -> StudySpec:
    return parse_spec({
        "name": f"published-{run.preset}", "model": run.preset, "num_gpus": run.gpus,
        "cluster": {"preset": "h100-80gb", "num_nodes": run.gpus // 8},
        "training": {"global_batch_size": run.global_batch, "precision": "bf16", **dict(run.training)},
        "space": {"tp": [1, 2, 4, 8], "pp": [1, 2, 4, 8, 16], "micro_batch_size": [1, 2, 4],
                  "zero_stage": [0, 2, 3], "activation_checkpoint": ["none", "selective", "moe_act", "layernorm", "layernorm+moe_act", "op", "full", "offload"],
                  "ep": [1, 2, 4, 8, 16, 32, 64]},
    })  # fmt: skip


# The terms shown, grouped (tuner/cost/terms.py StepTerms: intra- and inter-node parts summed).
TERM_GROUPS = {
    "compute": ("compute_s", "launch_floor_s", "microbatch_overhead_s"),
    "tp": ("tp_comm_intra_s", "tp_comm_inter_s", "collective_wait_s"),
    "pp bubble": ("pp_bubble_s",),
    "pp p2p": ("pp_p2p_intra_s", "pp_p2p_inter_s"),
    "dp": ("dp_comm_intra_s", "dp_comm_inter_s"),
    "all-to-all": ("moe_a2a_intra_s", "moe_a2a_inter_s"),
    "optimizer": ("optimizer_s",),
}


def terms_table() -> None:
    """Each published layout's predicted step by term, beside its published step."""
    print("| source | model | published step (s) | predicted step (s) | "
          + " | ".join(TERM_GROUPS) + " |")  # fmt: skip
    print("| --- | --- | --- | --- | " + " | ".join("---" for _ in TERM_GROUPS) + " |")
    for run in RUNS:
        spec = study(run)
        if run.layout.problems(spec.as_model_config()):
            continue
        est = Pricing.for_study(spec).estimate(run.layout)
        terms = est.terms.as_dict()
        step = est.step_time_s
        published = run.global_batch * spec.seq_len / (run.published * run.gpus)
        cells = []
        for names in TERM_GROUPS.values():
            seconds = sum(terms[n] for n in names)
            cells.append(f"{seconds:.2f} ({seconds / step:.0%})")
        print(f"| {run.source} | {run.preset} | {published:.2f} | {step:.2f} | " + " | ".join(cells) + " |")


def main() -> None:
    print(
        "| source | model | GPUs | layout priced | published tokens/s/GPU (stack) | predicted | predicted / published |"
        " predicted GiB | fits | planner's pick | its predicted tokens/s/GPU | its exports |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for run in RUNS:
        spec = study(run)
        pricing = Pricing.for_study(spec)
        problems = run.layout.problems(spec.as_model_config())
        if problems:
            print(f"| {run.source} | {run.preset} | {run.gpus} | {run.layout.describe()} | {run.published:,.0f} "
                  f"({run.stack}) | not expressible: {'; '.join(problems)} | | | | | | |")  # fmt: skip
            continue
        est = pricing.estimate(run.layout)
        tps = est.tokens_per_s / run.gpus
        ranked = pricing.rank(SearchSpace.from_spec(spec).enumerate().valid)
        best = fastest_fitting(ranked)
        pick = best[0].describe() if best else "none fits"
        pick_tps = f"{best[1].tokens_per_s / run.gpus:,.0f}" if best else ""
        note = f" ({run.mapped})" if run.mapped else ""
        print(f"| {run.source} | {run.preset} | {run.gpus} | {run.layout.describe()}{note} | {run.published:,.0f} "
              f"({run.stack}) | {tps:,.0f} | {tps / run.published:.2f} | {est.memory_bytes / 2**30:.1f} "
              f"| {'yes' if est.fits else 'no'} | {pick} | {pick_tps} | {exports_cell(spec, ranked, run.gpus)} |")  # fmt: skip


def exports_cell(spec: StudySpec, ranked: Ranked, gpus: int) -> str:
    """Which launch configs the planner's pick exports to (tuner.exports.refusals); where one
    refuses it, its reason and the fastest fitting layout that format can express."""
    fitting = [(c, e) for c, e in ranked if e.fits]
    if not fitting:
        return ""
    refused = refusals(spec, fitting[0][0])
    cells = []
    for fmt in ("megatron", "torchtitan"):
        if fmt not in refused:
            cells.append(f"{fmt}: yes")
            continue
        alt = next(((c, e) for c, e in fitting[1:] if fmt not in refusals(spec, c)), None)
        instead = f"{alt[0].describe()} at {alt[1].tokens_per_s / gpus:,.0f} tokens/s/GPU" if alt else "none"
        cells.append(f"{fmt}: no ({refused[fmt]}); its fastest: {instead}")
    return "; ".join(cells)


if __name__ == "__main__":
    import sys

    main()
    if "--terms" in sys.argv[1:]:
        print()
        terms_table()
