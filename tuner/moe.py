"""What a mixture of experts adds to a step: moved to tuner/cost/experts.py (the cost model by
parts). This module keeps the names callers import, with their old signatures."""

from __future__ import annotations

from trainer.contract.model import ModelConfig
from trainer.contract.parallel import ParallelConfig
from tuner.cost import experts
from tuner.cost.case import Case
from tuner.cost.collectives import Comm
from tuner.cost.experts import (
    DEFAULT_RIDGE_TOKENS,
    MoEStep,
    a2a_calls,
    imbalance_factor,
    local_expert_params,
    measured_imbalance,
    moe_activation_delta_per_token,
    moe_layer_dense_params,
    moe_layers_on,
    ridge_tokens,
    routed_tokens,
    tokens_per_expert,
)
from tuner.perfconstants import ModelConstants
from tuner.spec import ClusterSpec

__all__ = [
    "DEFAULT_RIDGE_TOKENS",
    "MoEStep",
    "a2a",
    "a2a_calls",
    "a2a_volume_bytes",
    "expert_gemm_efficiency",
    "imbalance_factor",
    "local_expert_params",
    "measured_imbalance",
    "moe_activation_delta_per_token",
    "moe_layer_dense_params",
    "moe_layers_on",
    "ridge_tokens",
    "routed_tokens",
    "tokens_per_expert",
]


def expert_gemm_efficiency(m: ModelConfig, p: ParallelConfig, cluster: ClusterSpec, precision: str) -> float:
    """The experts' GEMMs relative to a compute-bound GEMM (experts.expert_gemm_efficiency)."""
    return experts.expert_gemm_efficiency(Case(m, p, precision, ModelConstants(), cluster))


def a2a_volume_bytes(m: ModelConfig, p: ParallelConfig, precision: str) -> float:
    """Bytes one all-to-all moves out of a rank (experts.a2a_volume_bytes)."""
    return experts.a2a_volume_bytes(Case(m, p, precision, ModelConstants()))


def a2a(m: ModelConfig, p: ParallelConfig, cluster: ClusterSpec, precision: str, c: ModelConstants) -> Comm:
    """One MoE layer's all-to-alls for one micro-batch (experts.a2a)."""
    return experts.a2a(Case(m, p, precision, c, cluster))
