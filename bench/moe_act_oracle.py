"""The experts' activation recomputed (activation_checkpoint "moe_act": Megatron's
--recompute-modules moe_act, trainer/moe.py recompute_without_output) through the memory oracle,
next to the memory model, with the same layout without recompute: each simulated rank's peak and
the model's error. tests/tuner/test_moe_model.py's small MoE (4 layers, h 256, sequence 256) on
the oracle's GPU kernels and on CPU; a few seconds a layout.

    .venv/bin/python -m bench.moe_act_oracle [cuda] [cpu]
"""

from __future__ import annotations

import sys

from tests.tuner.test_moe_model import ORACLE_MOE
from trainer.contract.parallel import ParallelConfig
from trainer.contract.result import BenchmarkConfig
from trainer.memcheck import memcheck
from tuner.cost.case import Case
from tuner.cost.memory import phase_bytes
from tuner.perfconstants import ModelConstants

LAYOUTS = {
    "edp1": {"dp_shard": 2, "ep": 2, "zero_stage": 2, "micro_batch_size": 2, "num_microbatches": 2},
    "tp2-sp-ep2": {"tp": 2, "sequence_parallel": True, "dp_shard": 2, "ep": 2, "zero_stage": 2,
                   "micro_batch_size": 2, "num_microbatches": 2},
    "pp2-replicated": {"pp": 2, "dp_replicate": 2, "ep": 2, "micro_batch_size": 1, "num_microbatches": 4},
}  # fmt: skip


def main(devices: list[str]) -> None:
    print("| layout | mode | checkpointing | rank | oracle peak | model error |")
    print("| --- | --- | --- | --- | --- | --- |")
    constants = ModelConstants(memory_scale=1.0, workspace_bytes=0.0)
    for device in devices:
        precision, kind = ("bf16", "gpu") if device == "cuda" else ("fp32", "cpu")
        for name, knobs in LAYOUTS.items():
            for ac in ("none", "moe_act"):
                p = ParallelConfig(**knobs, activation_checkpoint=ac)
                cfg = BenchmarkConfig(model=ORACLE_MOE, parallel=p, device=device, moe_routing="balanced")
                case = Case(cfg.model, p, precision, constants, device=kind)
                for r in memcheck(cfg).ranks:
                    predicted = max(sum(v.values()) for v in phase_bytes(case, r.coords["pp"]).values())
                    error = (predicted - r.peak_bytes) / r.peak_bytes
                    print(
                        f"| {name} | {device} | {ac} | {r.rank} | {r.peak_bytes:,} | {error:+.2%} |",
                        flush=True,
                    )


if __name__ == "__main__":
    main(sys.argv[1:] or ["cuda", "cpu"])
