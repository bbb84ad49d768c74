"""The analytic memory model (tuner/memmodel.py) against the memory oracle (trainer/memcheck.py):
22B, 175B and 1T on 1024-3072 A100-80GB GPUs, in Korthikanti/Narayanan-style layouts (the large
suite); Llama 3.1 8B, 70B and 405B on 16-2048 H100-80GB GPUs (`--suite llama`); the mixtures of
experts Mixtral-8x7B, Qwen3-30B-A3B and Qwen3-235B-A22B with expert parallelism, their fit judged
on H100-80GB and on H200-141GB (`--suite moe`); Llama 3.1 8B and 70B at 32k-128k tokens with
context parallelism on H100-80GB (`--suite long`); the published BF16 layouts of
bench/moe_published.py and bench/cp_published.py as those scripts price them (`--suite published`).

    flock /tmp/parallel-tuner-measure.lock .venv/bin/python -m bench.memory_oracle --json  # large
    flock /tmp/parallel-tuner-measure.lock .venv/bin/python -m bench.memory_oracle --suite small --json
    flock /tmp/parallel-tuner-measure.lock .venv/bin/python -m bench.memory_oracle --suite llama --json
    flock /tmp/parallel-tuner-measure.lock .venv/bin/python -m bench.memory_oracle --suite moe --json
    flock /tmp/parallel-tuner-measure.lock .venv/bin/python -m bench.memory_oracle --suite long --json
    flock /tmp/parallel-tuner-measure.lock .venv/bin/python -m bench.memory_oracle --suite published --json

For every layout the oracle builds the trainer at full size on fake tensors ("cuda" mode: bf16
mixed precision, AdamW's fused step, every step's peak) for the first and the last pipeline rank,
with two micro-batch counts extended linearly to the layout's (trainer/memcheck.py). Layouts that
differ only in their global batch share those simulations. Each simulation is recorded in
--records (JSON lines), so a re-run simulates only what is missing and `--no-simulate` compares
the model with the recorded oracle alone (tests/tuner/test_memmodel.py does that). A mixture of
experts is simulated with balanced routing (its tokens per expert are the data's otherwise; the
model is asked at imbalance 1 to match) and its experts as grouped GEMMs (trainer/memcheck.py).

Error: |analytic - oracle| / oracle of the tensor bytes on the fullest rank (the model's
memory_bytes less its calibrated workspace_bytes, memory_scale 1). Fit: the same calibrated terms
added to both sides against the device's memory less the margin; a disagreement is a layout the
oracle says fits and the model says does not (the other direction, an OOM the model misses, is
counted apart).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from trainer.contract.model import ModelConfig
from trainer.contract.parallel import ParallelConfig
from trainer.contract.presets import MODEL_PRESETS
from trainer.contract.result import BenchmarkConfig
from trainer.memcheck import RankMemory, Simulation, Simulator, memcheck
from tuner.hardware import cluster_preset
from tuner.memmodel import memory
from tuner.perfconstants import ModelConstants
from tuner.plan import parse_pins
from tuner.space import layout
from tuner.spec import ClusterSpec, padded_model

ROOT = Path(__file__).resolve().parent.parent

RECORDS = ROOT / "bench" / "own_tables" / "memory_oracle.jsonl"  # the small suite's
LARGE_RECORDS = ROOT / "bench" / "own_tables" / "memory_oracle_large.jsonl"
LLAMA_RECORDS = ROOT / "bench" / "own_tables" / "memory_oracle_llama.jsonl"
CLUSTER = "a100-80gb"
LLAMA_CLUSTER = "h100-80gb"

# Each shape is a layout as `tuner plan --config` pins one (tuner/plan.py parse_pins: an axis's
# name or alias = its value, the axes left out at their default), dp and the micro-batch count
# derived from the GPUs and the global batch (ZeRO > 0 shards the whole dp):
# tp 8 within a node with SP and selective recompute is Korthikanti's recipe, pp as deep as the
# model needs (Narayanan table 1: 175B t8 p16 on 1024 GPUs, 1T t8 p64 on 3072), and around it
# what a planner weighs: less tp, full or no recompute, FSDP2 stages, GPipe and interleaving.
SHAPES: dict[str, list[str]] = {
    "gpt-22b": [
        "tp=8,ac=selective,sp=true",
        "tp=8,mbs=2,ac=selective,sp=true,zero=3",
        "tp=8,mbs=4,ac=full,sp=true,zero=2",
        "tp=8,zero=3",
        "tp=4,ac=selective,sp=true,zero=2",
        "tp=4,pp=2,sp=true",
        "tp=8,pp=2,mbs=2,ac=selective,zero=2",
        "tp=4,pp=4,pp_schedule=interleaved_1f1b,virtual_stages=2,ac=selective,sp=true",
        "tp=2,pp=4,pp_schedule=gpipe,ac=full,zero=3",
        # issue 37: op-level checkpointing, offload, the norms recomputed (Megatron's layernorm module)
        "tp=8,ac=op,sp=true,zero=2",
        "tp=8,ac=offload,sp=true,zero=3",
        "tp=8,ac=layernorm,sp=true,zero=2",
    ],
    "gpt-175b": [
        "tp=8,pp=16,ac=selective,sp=true",
        "tp=8,pp=8,ac=selective,sp=true,zero=2",
        "tp=8,pp=8,pp_schedule=interleaved_1f1b,virtual_stages=2,ac=selective,sp=true",
        "tp=8,pp=12,mbs=2,ac=full,sp=true,zero=3",
        "tp=4,pp=16,ac=full",
        "tp=8,pp=4,ac=full,sp=true,zero=3",
        "tp=8,pp=32,sp=true",
        # issue 37: the V schedules (block recompute is refused there), offload
        "tp=8,pp=8,pp_schedule=zbv,virtual_stages=2,sp=true,zero=2",
        "tp=8,pp=8,pp_schedule=dualpipev,virtual_stages=2,ac=layernorm,sp=true,zero=2",
        "tp=8,pp=8,ac=offload,sp=true,zero=2",
    ],
    "gpt-1t": [
        "tp=8,pp=64,ac=selective,sp=true",
        "tp=8,pp=32,ac=full,sp=true,zero=2",
        "tp=8,pp=32,pp_schedule=interleaved_1f1b,virtual_stages=2,ac=selective,sp=true",
        "tp=8,pp=16,ac=full,sp=true,zero=3",
        "tp=8,pp=64,mbs=2,ac=full",
        "tp=8,pp=32,ac=offload,sp=true,zero=2",  # issue 37
    ],
}
GPUS = {"gpt-22b": (1024, 2048), "gpt-175b": (1024, 2048), "gpt-1t": (2048, 3072)}
GLOBAL_BATCHES = {
    "gpt-22b": (1024, 2048, 4096),
    "gpt-175b": (1536, 3072, 6144),
    "gpt-1t": (3072, 6144, 12288),
}

# The Llama suite, at Llama 3's 8192-token context on H100-80GB. 8B as torchtitan trains it
# (FSDP2, no tp: torchtitan/models/llama3/train_configs/llama3_8b.toml) and around it tp within a
# node, a pipeline, replicated DP (which does not fit); 70B with tp 8 and FSDP or a pipeline
# (llama3_70b.toml: tp 8, full recompute); 405B as Llama 3 trained it (Llama Team 2024, table 4:
# tp 8, pp 16, interleaved, FSDP) and deeper, shallower and tp-free pipelines. Each with tp 1 too:
# FSDP alone or with a pipeline. Global batches in sequences: 1M-4M tokens (8B), 2M-8M (70B),
# Llama 3's 8M and 16M (405B).
LLAMA_SHAPES: dict[str, list[str]] = {
    "llama3.1-8b": [
        "zero=3",
        "ac=selective,zero=2",
        "mbs=2,ac=full,zero=3",
        "",
        "pp=2,ac=selective,zero=2",
        "pp=4,pp_schedule=interleaved_1f1b,virtual_stages=2",
        "pp=2,pp_schedule=gpipe,ac=full,zero=3",
        "tp=2,sp=true,zero=3",
        "tp=4,mbs=2,ac=selective,sp=true,zero=2",
        "tp=8,sp=true",
        "tp=2,pp=2,pp_schedule=gpipe,ac=full,zero=3",
        # issue 37: op-level checkpointing, offload, the V schedules (block recompute is refused there)
        "ac=op,zero=2",
        "ac=offload,zero=3",
        "pp=2,pp_schedule=zbv,virtual_stages=2,zero=2",
    ],
    "llama3.1-70b": [
        "ac=full,zero=3",
        "pp=4,ac=selective,zero=3",
        "pp=8,ac=full,zero=2",
        "tp=8,ac=full,sp=true,zero=3",
        "tp=8,pp=2,sp=true,zero=2",
        "tp=8,pp=4,ac=selective,sp=true",
        "tp=4,pp=4,pp_schedule=interleaved_1f1b,virtual_stages=2,ac=selective,sp=true,zero=2",
        "tp=8,ac=op,sp=true,zero=3",
        "tp=8,pp=4,pp_schedule=dualpipev,virtual_stages=2,sp=true,zero=2",
    ],
    "llama3.1-405b": [
        "pp=16,ac=full,zero=3",
        "pp=32,ac=selective,zero=3",
        "tp=8,pp=16,pp_schedule=interleaved_1f1b,virtual_stages=2,sp=true,zero=2",
        "tp=8,pp=16,ac=selective,sp=true,zero=2",
        "tp=8,pp=8,ac=full,sp=true,zero=3",
        "tp=8,pp=32,sp=true",
        "tp=4,pp=16,ac=full,sp=true,zero=3",
    ],
}
LLAMA_GPUS = {"llama3.1-8b": (16, 64), "llama3.1-70b": (64, 256), "llama3.1-405b": (1024, 2048)}
LLAMA_GLOBAL_BATCHES = {"llama3.1-8b": (128, 512), "llama3.1-70b": (256, 1024), "llama3.1-405b": (1024, 2048)}
# The MoE suite (issue 27), at 4096 tokens, shapes with expert parallelism (ep,
# folded into dp x tp as the trainer does; SP wherever tp > 1, as EP with TP needs). Mixtral-8x7B
# (8 experts of 14336, top 2) as Megatron's MoE recipes run it (tp 1, ep 8, pp 4-8; Megatron-LM
# examples/mixtral) and around it tp 2-8 with smaller ep, interleaving and GPipe; Qwen3-30B-A3B
# (128 thin experts, top 8) on 2 nodes: FSDP with ep 8-16 as torchtitan's qwen3 configs and
# Megatron-Bridge's recipe (pp 2, ep 8) do, tp 2-4, a pipeline of 4; Qwen3-235B-A22B (94 layers,
# uneven stages) on 16 nodes: Megatron-Bridge's pp 8-16 with ep 8 and tp 1-8, ep 16-32 across nodes.
# One GPU count per model, three global batches (they share the simulations): 72 layouts; each
# fit judged on both clusters (the oracle's bytes do not depend on the device).
MOE_SHAPES: dict[str, list[str]] = {
    "mixtral-8x7b": [
        "pp=4,ac=selective,zero=2,ep=8",
        "pp=8,ac=full,zero=3,ep=8",
        "tp=2,pp=4,ac=selective,sp=true,zero=2,ep=4",
        "tp=4,pp=2,ac=full,sp=true,zero=3,ep=8",
        "pp=4,pp_schedule=interleaved_1f1b,virtual_stages=2,ac=full,ep=8",
        "tp=2,pp=8,mbs=2,ac=full,sp=true,zero=2,ep=2",
        "pp=2,pp_schedule=gpipe,ac=full,zero=3,ep=8",
        "tp=8,ac=full,sp=true,zero=3,ep=8",
    ],
    "qwen3-30b-a3b": [
        "ac=full,zero=3,ep=8",
        "pp=2,ac=full,zero=2,ep=8",
        "pp=4,mbs=2,ac=selective,zero=2,ep=4",
        "tp=2,pp=2,ac=selective,sp=true,zero=2,ep=4",
        "mbs=2,ac=full,zero=3,ep=16",
        "tp=4,ac=full,sp=true,zero=3,ep=8",
        "pp=4,pp_schedule=interleaved_1f1b,virtual_stages=2,ep=4",
        "tp=2,ac=selective,sp=true,zero=3,ep=2",
        # issue 37: Megatron's recompute modules, torchtitan's op-level policy, offload, V schedules
        "ac=moe_act,zero=3,ep=8",
        "pp=2,ac=moe_act,zero=2,ep=8",
        "tp=2,ac=layernorm+moe_act,sp=true,zero=3,ep=4",
        "ac=op,zero=3,ep=8",
        "ac=offload,zero=3,ep=8",
        # refused since (a V schedule with block recompute: the oracle 71.4 GiB, priced 46.0); its
        # simulation stays recorded
        "pp=2,pp_schedule=zbv,virtual_stages=2,ac=full,zero=2,ep=8",
        "pp=2,pp_schedule=dualpipev,virtual_stages=2,ac=moe_act,zero=2,ep=8",
    ],
    "qwen3-235b-a22b": [
        "pp=8,ac=full,zero=2,ep=16",
        "tp=2,pp=8,ac=selective,sp=true,zero=2,ep=8",
        "tp=4,pp=4,ac=full,sp=true,zero=3,ep=8",
        "pp=16,ac=selective,ep=8",
        "tp=4,pp=8,pp_schedule=interleaved_1f1b,virtual_stages=2,ac=full,sp=true,zero=2,ep=8",
        "pp=4,ac=full,zero=3,ep=32",
        "tp=2,pp=4,mbs=2,ac=full,sp=true,zero=2,ep=16",
        "tp=2,pp=16,pp_schedule=gpipe,ac=full,sp=true,zero=2,ep=4",
    ],
}
MOE_GPUS = {"mixtral-8x7b": (64,), "qwen3-30b-a3b": (16,), "qwen3-235b-a22b": (128,)}
MOE_GLOBAL_BATCHES = {"mixtral-8x7b": (128, 256, 512), "qwen3-30b-a3b": (64, 128, 256),
                      "qwen3-235b-a22b": (256, 512, 1024)}  # fmt: skip
MOE_RECORDS = ROOT / "bench" / "own_tables" / "memory_oracle_moe.jsonl"
# The long-sequence suite (issue 28): Llama 3.1 8B and 70B at 32k-128k tokens on H100-80GB with
# context parallelism (cp, folded with dp: FSDP2 over dp_shard x cp) and the sequence length
# (seq=, not an axis: the model's). 8B on 64 GPUs as the plan of issue 28 weighs it (FSDP with cp
# 2-16, tp 1-4 with SP, a pipeline, replicated weights); 70B on 256 GPUs with tp 8 in a node and
# cp 2-8 across nodes (Megatron's long-context recipes: tp 8, cp 2-8, pp 1-4), interleaving, no
# recompute at 32k. Three global batches per model (1-8M tokens), sharing the simulations.
LONG_SHAPES: dict[str, list[str]] = {
    "llama3.1-8b": [
        "ac=full,zero=3,cp=8,seq=131072",
        "tp=2,ac=full,sp=true,zero=3,cp=16,seq=131072",
        "ac=selective,zero=2,cp=4,seq=32768",
        "tp=2,sp=true,zero=3,cp=4,seq=65536",
        "pp=2,ac=full,zero=2,cp=4,seq=65536",
        "tp=4,ac=full,sp=true,cp=2,seq=32768",
        "pp=4,pp_schedule=interleaved_1f1b,virtual_stages=2,ac=selective,zero=2,cp=2,seq=65536",
        # issue 37: offload, a V schedule (op-level checkpointing is refused with cp)
        "ac=offload,zero=3,cp=8,seq=131072",
        "tp=2,ac=offload,sp=true,zero=3,cp=4,seq=65536",
        "pp=2,pp_schedule=zbv,virtual_stages=2,zero=2,cp=4,seq=32768",
    ],
    "llama3.1-70b": [
        "tp=8,ac=full,sp=true,zero=3,cp=4,seq=131072",
        "tp=8,pp=2,ac=full,sp=true,zero=2,cp=2,seq=65536",
        "tp=4,pp=4,ac=selective,sp=true,zero=2,cp=2,seq=32768",
        "tp=8,ac=full,sp=true,zero=3,cp=8,seq=131072",
        "tp=2,pp=4,pp_schedule=interleaved_1f1b,virtual_stages=2,ac=full,sp=true,zero=2,cp=4,seq=65536",
        "tp=8,pp=4,sp=true,cp=2,seq=32768",
    ],
}
LONG_GPUS = {"llama3.1-8b": (64,), "llama3.1-70b": (256,)}
LONG_GLOBAL_BATCHES = {"llama3.1-8b": (32, 64, 128), "llama3.1-70b": (64, 128, 256)}
LONG_RECORDS = ROOT / "bench" / "own_tables" / "memory_oracle_long.jsonl"
MOE_CLUSTERS = ("h100-80gb", "h200-141gb")
SUITES = {  # name: (shapes, GPU counts, global batches, clusters (fit judged on each), records)
    "large": (SHAPES, GPUS, GLOBAL_BATCHES, (CLUSTER,), LARGE_RECORDS),
    "small": ({}, {}, {}, (CLUSTER,), RECORDS),  # SMALL_LAYOUTS (layouts()), fit judged on A100-80GB
    "llama": (LLAMA_SHAPES, LLAMA_GPUS, LLAMA_GLOBAL_BATCHES, (LLAMA_CLUSTER,), LLAMA_RECORDS),
    "moe": (MOE_SHAPES, MOE_GPUS, MOE_GLOBAL_BATCHES, MOE_CLUSTERS, MOE_RECORDS),
    "long": (LONG_SHAPES, LONG_GPUS, LONG_GLOBAL_BATCHES, (LLAMA_CLUSTER,), LONG_RECORDS),
    # the published BF16 layouts (published_layouts), on their H100s
    "published": (
        {},
        {},
        {},
        (LLAMA_CLUSTER,),
        ROOT / "bench" / "own_tables" / "memory_oracle_published.jsonl",
    ),
}

# The small suite: a model whose activations and parameters both weigh (8 layers, h 128, s 256),
# every schedule, ZeRO stage and recompute mode the trainer has, simulated whole in seconds, as a
# GPU ("cuda": bf16) and a CPU trial (fp32, exactly what the trainer measures on CPU).
SMALL = ModelConfig(num_layers=8, hidden_size=128, num_heads=4, vocab_size=1024, seq_len=256)
SMALL_LAYOUTS = [
    dict(dp_shard=2, zero_stage=3, micro_batch_size=2, num_microbatches=1),
    dict(dp_shard=2, zero_stage=3, micro_batch_size=2, num_microbatches=3),
    dict(dp_shard=2, zero_stage=2, micro_batch_size=2, num_microbatches=3),
    dict(dp_replicate=2, micro_batch_size=2, num_microbatches=3),
    dict(tp=2, dp_replicate=2, micro_batch_size=2, num_microbatches=3, sequence_parallel=True, activation_checkpoint="selective"),
    dict(tp=2, dp_shard=2, zero_stage=3, micro_batch_size=2, num_microbatches=2, activation_checkpoint="full"),
    dict(pp=2, dp_replicate=2, micro_batch_size=2, num_microbatches=6),
    dict(pp=2, dp_shard=2, zero_stage=3, micro_batch_size=2, num_microbatches=6, activation_checkpoint="full"),
    dict(pp=4, tp=2, dp_shard=2, zero_stage=2, micro_batch_size=1, num_microbatches=8, sequence_parallel=True),
    dict(pp=2, tp=2, dp_replicate=2, micro_batch_size=1, num_microbatches=8, pp_schedule="gpipe", activation_checkpoint="selective"),
    dict(pp=2, dp_replicate=2, micro_batch_size=1, num_microbatches=8, pp_schedule="interleaved_1f1b", virtual_stages=2),
    dict(pp=4, tp=2, dp_shard=2, zero_stage=3, micro_batch_size=1, num_microbatches=12, sequence_parallel=True, activation_checkpoint="selective"),
    dict(pp=3, tp=2, dp_shard=2, zero_stage=2, micro_batch_size=1, num_microbatches=6, activation_checkpoint="full", sequence_parallel=True),
    dict(pp=2, dp_shard=2, zero_stage=3, micro_batch_size=4, num_microbatches=4, pp_schedule="gpipe", activation_checkpoint="full"),
    dict(tp=2, pp=2, dp_replicate=2, micro_batch_size=1, num_microbatches=8, pp_schedule="interleaved_1f1b", virtual_stages=2,
         sequence_parallel=True, activation_checkpoint="selective"),
    dict(micro_batch_size=2, num_microbatches=2),
    dict(tp=2, dp_replicate=2, dp_shard=2, zero_stage=3, micro_batch_size=1, num_microbatches=4),
    # 2D tensor parallelism (tp_col, trainer/tp2d.py)
    dict(tp_col=2, micro_batch_size=2, num_microbatches=2),
    dict(tp=2, tp_col=2, dp_shard=2, zero_stage=3, micro_batch_size=2, num_microbatches=2),
    dict(tp_col=2, pp=2, micro_batch_size=1, num_microbatches=4),
    dict(tp_col=2, dp_replicate=2, micro_batch_size=2, num_microbatches=2, activation_checkpoint="full"),
    dict(tp_col=4, micro_batch_size=2, num_microbatches=2),
    # tensor parallelism without data parallelism: a plain parameter beside DTensor ones (AdamW's groups)
    dict(tp=2, micro_batch_size=2, num_microbatches=2, sequence_parallel=True),
    dict(tp=2, pp=2, micro_batch_size=1, num_microbatches=4, activation_checkpoint="selective"),
]  # fmt: skip


def _shape(text: str) -> tuple[dict[str, Any], int | None]:
    """A shape's pinned axes and its sequence length (seq=; None: the preset's)."""
    items = text.split(",")
    seq = [int(item.removeprefix("seq=")) for item in items if item.startswith("seq=")]
    pins = parse_pins(",".join(item for item in items if not item.startswith("seq=")))
    return pins, (seq[0] if seq else None)


def published_layouts() -> list[tuple[str, ModelConfig, ParallelConfig, str]]:
    """The published BF16 layouts of bench/moe_published.py and bench/cp_published.py, each as
    that script prices it (its FP8 rows are issue 38's: the trainer has no FP8 yet)."""
    from bench import cp_published, moe_published
    from tuner.pricing import Pricing

    out = []
    for run in moe_published.RUNS:
        if "BF16" in run.stack:
            model = padded_model(moe_published.study(run).as_model_config(), run.layout.tp)
            out.append((run.preset, model, run.layout, "cuda"))
    for run in cp_published.RUNS:
        if run.stack == "BF16":
            spec = cp_published.study(run)
            p = cp_published.priced_layout(run, Pricing.for_study(spec))
            out.append((run.preset, padded_model(spec.as_model_config(), p.tp), p, "cuda"))
    return out


def layouts(suite: str = "large") -> list[tuple[str, ModelConfig, ParallelConfig, str]]:
    """Every (label, model, layout, device) of a suite, valid for the trainer."""
    if suite == "small":
        return [
            ("small", SMALL, ParallelConfig(**k), device) for device in ("cuda", "cpu") for k in SMALL_LAYOUTS
        ]
    if suite == "published":
        return published_layouts()
    out = []
    all_shapes, all_gpus, batches = SUITES[suite][:3]
    for name, shapes in all_shapes.items():
        for shape, gpus, gbs in itertools.product(shapes, all_gpus[name], batches[name]):
            pins, seq = _shape(shape)
            knobs = ParallelConfig(**pins)  # dp 1: the degrees and the micro-batch
            dp = gpus // (knobs.tp * knobs.pp * knobs.cp)
            if gpus % (knobs.tp * knobs.pp * knobs.cp) or gbs % (dp * knobs.micro_batch_size):
                continue
            p = layout(**pins, dp=dp, num_microbatches=gbs // (dp * knobs.micro_batch_size))
            model = (
                MODEL_PRESETS[name] if seq is None else dataclasses.replace(MODEL_PRESETS[name], seq_len=seq)
            )
            model = padded_model(model, p.tp)
            if not p.problems(model):
                out.append((name, model, p, "cuda"))
    return out


def compare(rows: list[dict[str, Any]], c: ModelConstants, cluster: ClusterSpec) -> dict[str, Any]:
    """Errors and fit agreement of the analytic model on oracle rows."""
    budget = cluster.device_memory_bytes * (1 - c.memory_margin)
    errors, disagree, missed, fits = [], [], [], 0
    for row in rows:
        model, p = ModelConfig.from_dict(row["model"]), ParallelConfig.from_dict(row["parallel"])
        gpu = row["device"] == "cuda"
        mem = memory(model, p, "bf16" if gpu else "fp32", c, "gpu" if gpu else "cpu")
        predicted = (mem["memory_bytes"] - c.workspace_bytes) / c.memory_scale
        oracle = row["oracle_bytes"]
        row["analytic_bytes"] = round(predicted)
        row["error"] = (predicted - oracle) / oracle
        errors.append(abs(row["error"]))
        oracle_fits = oracle * c.memory_scale + c.workspace_bytes <= budget
        model_fits = mem["memory_bytes"] <= budget
        fits += oracle_fits
        if oracle_fits and not model_fits:
            disagree.append(row)
        if model_fits and not oracle_fits:
            missed.append(row)
    return {
        "layouts": len(rows),
        "median_error": statistics.median(errors),
        "max_error": max(errors),
        "fit_disagreements": len(disagree),
        "missed_ooms": len(missed),
        "disagreements": [_label(r) for r in disagree + missed],
        "oracle_fits": fits,
    }


def _label(row: dict[str, Any]) -> str:
    p = ParallelConfig.from_dict(row["parallel"])
    return f"{row['name']} {row['gpus']} GPUs {p.describe()}: oracle {row['oracle_bytes'] / 2**30:.1f} GiB, model {row['analytic_bytes'] / 2**30:.1f} GiB"


class RecordingSimulator(Simulator):
    """A Simulator whose results are kept in a JSON-lines file across runs."""

    def __init__(self, path: Path, simulate: bool = True) -> None:
        super().__init__(cache=True)
        self.path, self.simulate, self.simulated_s = path, simulate, 0.0
        lines = path.read_text().splitlines() if path.exists() else []
        for record in map(json.loads, lines):
            sim = record["simulation"]
            key = Simulation(**sim | {"cfg": BenchmarkConfig.from_dict(sim["cfg"])})
            self.cache[key] = RankMemory.from_dict(record["memory"])

    def _in_children(self, sims: list[Simulation]) -> list[RankMemory]:
        if not self.simulate:
            raise LookupError(f"{len(sims)} simulations are not recorded in {self.path}")
        started = time.perf_counter()
        done = super()._in_children(sims)
        self.simulated_s += time.perf_counter() - started
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            for sim, result in zip(sims, done, strict=True):
                record = {
                    "simulation": dataclasses.asdict(sim),
                    "memory": result.to_dict(),
                    "torch": torch.__version__,
                }
                f.write(json.dumps(record) + "\n")
        return done


def run_oracle(
    todo: list[tuple[str, ModelConfig, ParallelConfig, str]], records: Path, simulate: bool
) -> list[dict[str, Any]]:
    """One row per layout from the recorded simulations, simulating the missing ones."""
    simulator = RecordingSimulator(records, simulate=simulate)
    rows = []
    for i, (name, model, p, device) in enumerate(todo):
        cfg = BenchmarkConfig(
            model=model, parallel=p, device=device, dtype="bf16" if device == "cuda" else "fp32",
            moe_routing="balanced" if model.moe else "learned",  # the oracle routes experts balanced
        )  # fmt: skip
        before = simulator.simulated_s
        try:
            report = memcheck(cfg, extrapolate=device == "cuda", simulator=simulator)
        except LookupError:  # --no-simulate and not recorded
            continue
        worst = report.worst
        rows.append({
            "name": name, "model": model.to_dict(), "gpus": p.world_size, "parallel": p.to_dict(), "device": device,
            "oracle_bytes": worst.peak_bytes, "worst_rank": worst.rank, "phase": worst.phase,
            "breakdown": worst.breakdown, "microbatches_simulated": report.microbatches_simulated,
            "oracle_cpu_s": sum(r.seconds for r in report.ranks), "wall_s": report.seconds,
            "simulated_s": simulator.simulated_s - before,
        })  # fmt: skip
        if simulate:
            print(f"[{i + 1}/{len(todo)}] {name} {p.describe()}: {worst.peak_bytes / 2**30:.2f} GiB "
                  f"({worst.phase}), {report.seconds:.0f} s", file=sys.stderr, flush=True)  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument(
        "--suite",
        choices=("large", "llama", "long", "moe", "small", "published"),
        default="large",
        help="which layouts (default large)",
    )
    parser.add_argument(
        "--records",
        type=Path,
        help=f"recorded simulations (JSON lines; default large: {LARGE_RECORDS.name}, small: {RECORDS.name}, "
        f"llama: {LLAMA_RECORDS.name}, moe: {MOE_RECORDS.name}, long: {LONG_RECORDS.name})",
    )
    parser.add_argument("--no-simulate", action="store_true", help="use the recorded simulations only")
    parser.add_argument(
        "--models", help="large, llama, long and moe suites: comma-separated subset (default all)"
    )
    parser.add_argument("--max-tp", type=int, help="only layouts with tp at most this")
    parser.add_argument("--rows", type=Path, help="also write every layout's row here (JSON)")
    args = parser.parse_args(argv)
    shapes, _, _, clusters, records = SUITES.get(args.suite, SUITES["large"])
    models = args.models.split(",") if args.models else list(shapes)
    todo = [
        x for x in layouts(args.suite)
        if (args.suite in ("small", "published") or x[0] in models) and (args.max_tp is None or x[2].tp <= args.max_tp)
    ]  # fmt: skip
    started = time.perf_counter()
    rows = run_oracle(todo, args.records or records, simulate=not args.no_simulate)
    if not rows:
        print("no layout has a recorded simulation; run without --no-simulate", file=sys.stderr)
        return 1
    fits = {name: compare(rows, ModelConstants(), ClusterSpec(**cluster_preset(name))) for name in clusters}
    summary = fits[clusters[0]]  # the errors do not depend on the cluster, the fit does
    if len(clusters) > 1:
        summary |= {"fit_by_cluster": {n: {k: f[k] for k in ("fit_disagreements", "missed_ooms", "disagreements",
                                                              "oracle_fits")} for n, f in fits.items()}}  # fmt: skip
    cold = [r["wall_s"] for r in rows if r["simulated_s"] > 0]  # simulated now, not recorded before
    names = dict.fromkeys(r["name"] for r in rows)
    summary |= {
        "oracle_s_per_layout": statistics.median(cold) if cold else None,
        "oracle_cpu_s_per_layout": statistics.median(r["oracle_cpu_s"] for r in rows),
        "oracle_cpu_s_per_layout_by_model": {
            n: statistics.median(r["oracle_cpu_s"] for r in rows if r["name"] == n) for n in names
        },
        "simulated_now": len(cold),
        "wall_s": time.perf_counter() - started,
        "cluster": clusters[0] if len(clusters) == 1 else list(clusters),
    }  # fmt: skip
    if args.rows:
        args.rows.write_text(json.dumps(rows, indent=1))
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        for key, value in summary.items():
            print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
