"""Context parallelism's price: moved to tuner/cost/context.py (the cost model by parts). This
module keeps the names callers import, with their old signatures."""

from __future__ import annotations

from trainer.contract.model import ModelConfig
from trainer.contract.parallel import ParallelConfig
from tuner.cost import context
from tuner.cost.case import Case
from tuner.cost.collectives import Comm
from tuner.cost.context import (
    attention_keys,
    gathered_kv_bytes,
    keys_per_query,
    kv_calls,
    local_tokens,
    mask_bytes,
    scored_pairs,
)
from tuner.perfconstants import ModelConstants
from tuner.spec import ClusterSpec

__all__ = [
    "attention_keys",
    "gathered_kv_bytes",
    "keys_per_query",
    "kv_bytes",
    "kv_calls",
    "kv_traffic",
    "local_tokens",
    "mask_bytes",
    "scored_pairs",
]


def kv_bytes(m: ModelConfig, p: ParallelConfig, precision: str) -> float:
    """One gathered K (or V) of a micro-batch on a rank (context.kv_bytes)."""
    return context.kv_bytes(Case(m, p, precision, ModelConstants()))


def kv_traffic(
    m: ModelConfig, p: ParallelConfig, cluster: ClusterSpec, precision: str, c: ModelConstants
) -> Comm:
    """One layer's K/V traffic for one micro-batch (context.kv_traffic)."""
    return context.kv_traffic(Case(m, p, precision, c, cluster))
