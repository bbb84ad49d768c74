"""Op-level checkpointing (activation_checkpoint "op": torchtitan's SelectiveAC policy,
trainer/parallelize.py) through the memory oracle, next to the memory model and next to the same
layout without recompute: each first rank's peak, the model's error, and what op saved by each.
Small models (4 layers, sequence 256) on the oracle's GPU kernels and on CPU; a few seconds a
layout.

    .venv/bin/python -m bench.op_checkpoint_oracle
"""

from __future__ import annotations

import dataclasses

from trainer.contract.parallel import ParallelConfig
from trainer.contract.presets import MODEL_PRESETS
from trainer.contract.result import BenchmarkConfig
from trainer.memcheck import memcheck
from tuner.cost.case import Case
from tuner.cost.memory import phase_bytes
from tuner.perfconstants import ModelConstants

CASES = [  # (name, preset, layout)
    ("llama tp1", "llama-small", {}),
    ("gpt tp1", "gpt-small", {}),
    ("llama tp2 sp", "llama-small", {"tp": 2, "sequence_parallel": True}),
    ("llama dps2 z3", "llama-small", {"dp_shard": 2, "zero_stage": 3}),
    ("llama pp2", "llama-small", {"pp": 2, "num_microbatches": 4}),
    ("moe tp1", "moe-small", {}),
    ("moe dps2 ep2 z2", "moe-small", {"dp_shard": 2, "ep": 2, "zero_stage": 2}),
    ("deepseek-shaped tp1", "moe-tiny-ds", {}),
]


def peaks(model, parallel: ParallelConfig, device: str) -> tuple[int, float]:
    """(the oracle's peak on rank 0, the model's) in bytes."""
    routing = {"moe_routing": "balanced"} if model.moe else {}
    rank = memcheck(BenchmarkConfig(model=model, parallel=parallel, device=device, **routing)).ranks[0]
    precision, kind = ("bf16", "gpu") if device == "cuda" else ("fp32", "cpu")
    case = Case(
        model, parallel, precision, ModelConstants(memory_scale=1.0, workspace_bytes=0.0), device=kind
    )
    predicted = max(sum(parts.values()) for parts in phase_bytes(case, rank.coords["pp"]).values())
    return rank.peak_bytes, predicted


def main() -> None:
    print(
        "| device | layout | none: oracle (B) | model error | op: oracle (B) | model error | op saves: oracle | model |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for device in ("cuda", "cpu"):
        for name, preset, layout in CASES:
            model = dataclasses.replace(MODEL_PRESETS[preset], num_layers=4, seq_len=256)
            none, op = (
                peaks(model, ParallelConfig(activation_checkpoint=ac, micro_batch_size=2, **layout), device)
                for ac in ("none", "op")
            )
            print(f"| {device} | {name} | {none[0]:,} | {none[1] / none[0] - 1:+.2%} | {op[0]:,} | "
                  f"{op[1] / op[0] - 1:+.2%} | {1 - op[0] / none[0]:.1%} | {1 - op[1] / none[1]:.1%} |")  # fmt: skip


if __name__ == "__main__":
    main()
