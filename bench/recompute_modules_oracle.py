"""Megatron's recompute modules as the trainer builds them (activation_checkpoint "moe_act",
"layernorm", "layernorm+moe_act": trainer/moe.py recompute_without_output) through the memory
oracle, next to the memory model, with the same layout without recompute: each simulated rank's
peak and the model's error. Small dense models (4 layers, sequence 256) and
tests/tuner/test_moe_model.py's small MoE, on the oracle's GPU kernels and on CPU; a few seconds a
layout.

    .venv/bin/python -m bench.recompute_modules_oracle [cuda] [cpu]
"""

from __future__ import annotations

import dataclasses
import sys

from tests.tuner.test_moe_model import ORACLE_MOE
from trainer.contract.parallel import ParallelConfig
from trainer.contract.presets import MODEL_PRESETS
from trainer.contract.result import BenchmarkConfig
from trainer.memcheck import memcheck
from tuner.cost.case import Case
from tuner.cost.memory import phase_bytes
from tuner.perfconstants import ModelConstants

SMALL = {"num_layers": 4, "seq_len": 256}
DENSE = ("none", "layernorm")
MOE = ("none", "moe_act", "layernorm", "layernorm+moe_act")
CASES = [  # (name, model, layout, values)
    ("llama tp1", dataclasses.replace(MODEL_PRESETS["llama-small"], **SMALL), {}, DENSE),
    ("gpt tp1", dataclasses.replace(MODEL_PRESETS["gpt-small"], **SMALL), {}, DENSE),
    ("llama tp2 sp", dataclasses.replace(MODEL_PRESETS["llama-small"], **SMALL),
     {"tp": 2, "sequence_parallel": True}, DENSE),
    ("llama dps2 z3", dataclasses.replace(MODEL_PRESETS["llama-small"], **SMALL),
     {"dp_shard": 2, "zero_stage": 3}, DENSE),
    ("llama pp2", dataclasses.replace(MODEL_PRESETS["llama-small"], **SMALL), {"pp": 2, "num_microbatches": 4}, DENSE),
    ("moe edp1", ORACLE_MOE, {"dp_shard": 2, "ep": 2, "zero_stage": 2, "num_microbatches": 2}, MOE),
    ("moe tp2-sp-ep2", ORACLE_MOE, {"tp": 2, "sequence_parallel": True, "dp_shard": 2, "ep": 2, "zero_stage": 2,
                                    "num_microbatches": 2}, MOE),
    ("moe pp2-replicated", ORACLE_MOE, {"pp": 2, "dp_replicate": 2, "ep": 2, "micro_batch_size": 1,
                                        "num_microbatches": 4}, MOE),
]  # fmt: skip


def main(devices: list[str]) -> None:
    print("| layout | mode | checkpointing | rank | oracle peak | model error |")
    print("| --- | --- | --- | --- | --- | --- |")
    constants = ModelConstants(memory_scale=1.0, workspace_bytes=0.0)
    for device in devices:
        precision, kind = ("bf16", "gpu") if device == "cuda" else ("fp32", "cpu")
        for name, model, knobs, values in CASES:
            for ac in values:
                p = ParallelConfig(**{"micro_batch_size": 2, **knobs}, activation_checkpoint=ac)
                cfg = BenchmarkConfig(model=model, parallel=p, device=device, moe_routing="balanced")
                if p.problems(model):  # a refused layout says why (trainer/contract/rules.py ac_rules)
                    print(f"| {name} | {device} | {ac} | | refused: {'; '.join(p.problems(model))} | |")
                    continue
                case = Case(model, p, precision, constants, device=kind)
                for r in memcheck(cfg).ranks:
                    predicted = max(sum(v.values()) for v in phase_bytes(case, r.coords["pp"]).values())
                    error = (predicted - r.peak_bytes) / r.peak_bytes
                    row = f"| {name} | {device} | {ac} | {r.rank} | {r.peak_bytes:,} | {error:+.2%} |"
                    print(row, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["cuda", "cpu"])
