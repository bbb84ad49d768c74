"""The analytic memory model against the memory oracle on every simulated rank: what
tests/tuner/test_memmodel.py, test_moe_model.py and test_cp_model.py check for small layouts."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer.contract.result import BenchmarkConfig
from tuner.cost.case import Case
from tuner.cost.experts import priced_imbalance
from tuner.cost.memory import phase_bytes
from tuner.perfconstants import ModelConstants

if TYPE_CHECKING:
    from trainer.memcheck import MemoryReport


def assert_every_rank_matches_the_oracle(cfg: BenchmarkConfig, tolerance: float) -> MemoryReport:
    """memcheck(cfg) against phase_bytes of each simulated rank's pipeline stage (tensor bytes:
    memory_scale 1, no workspace), within `tolerance` of the oracle's peak; the oracle's report."""
    from trainer.memcheck import memcheck

    report = memcheck(cfg)
    c = ModelConstants(memory_scale=1.0, workspace_bytes=0.0)
    precision, kind = ("bf16", "gpu") if cfg.device == "cuda" else ("fp32", "cpu")
    # balanced routing (the oracle's), capped by a token-drop capacity factor as a study prices it
    imbalance = priced_imbalance(1.0, cfg.moe_capacity_factor)
    case = Case(cfg.model, cfg.parallel, precision, c, device=kind, moe_imbalance=imbalance,
                grad_reduce_dtype=cfg.grad_reduce_dtype)  # fmt: skip
    for rank in report.ranks:
        phases = phase_bytes(case, rank.coords["pp"])
        predicted = max(sum(parts.values()) for parts in phases.values())
        assert abs(predicted - rank.peak_bytes) / rank.peak_bytes < tolerance, (
            rank.rank,
            predicted,
            rank.peak_bytes,
        )
    return report
