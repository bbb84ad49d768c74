"""The small MoE layouts of tests/tuner/test_moe_model.py (`ORACLE_MOE_LAYOUTS`, and DeepSeek's
router `ORACLE_DS_CASES`) through the memory oracle, next to the memory model: each simulated
rank's peak and the model's error. A few seconds a layout; run before and after a change to
trainer/moe.py to see what it moved.

    .venv/bin/python -m bench.moe_oracle_small
"""

from __future__ import annotations

from tests.tuner.test_moe_model import ORACLE_DS_CASES, ORACLE_MOE, ORACLE_MOE_LAYOUTS
from trainer.contract.result import BenchmarkConfig
from trainer.memcheck import memcheck
from tuner.cost.case import Case
from tuner.cost.memory import phase_bytes
from tuner.perfconstants import ModelConstants


def main() -> None:
    constants = ModelConstants(memory_scale=1.0, workspace_bytes=0.0)
    cases = [(f"{device} {p.id}", ORACLE_MOE, p.values[0], device) for device in ("cuda", "cpu")
             for p in ORACLE_MOE_LAYOUTS]  # fmt: skip
    cases += [(f"cuda ds-{p.id}", *p.values, "cuda") for p in ORACLE_DS_CASES]
    print("| case | rank | oracle peak (B) | model (B) | model error |")
    print("| --- | --- | --- | --- | --- |")
    for name, model, parallel, device in cases:
        report = memcheck(
            BenchmarkConfig(model=model, parallel=parallel, device=device, moe_routing="balanced")
        )
        precision, kind = ("bf16", "gpu") if device == "cuda" else ("fp32", "cpu")
        case = Case(model, parallel, precision, constants, device=kind)
        for rank in report.ranks:
            predicted = max(sum(parts.values()) for parts in phase_bytes(case, rank.coords["pp"]).values())
            error = (predicted - rank.peak_bytes) / rank.peak_bytes
            print(
                f"| {name} | {rank.rank} | {rank.peak_bytes:,} | {predicted:,.0f} | {error:+.2%} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
