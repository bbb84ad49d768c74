"""The analytic memory model's entry points: bytes on a layout's fullest device as the trainer
(trainer/) holds them. The model is tuner/cost/memory.py (the assembly) over each axis's part
(tuner/cost/layer.py, pipeline.py, data.py, context.py, experts.py); this module keeps the names
and signatures callers import (the fitting, the memory oracle's comparisons, the tests).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer.contract.model import ModelConfig
from trainer.contract.parallel import ParallelConfig
from tuner.cost import memory as memory_model
from tuner.cost.case import Case
from tuner.cost.data import model_state_bytes
from tuner.cost.layer import activation_bytes_per_token, layer_params
from tuner.cost.memory import PARTS, RankBytes, rank_bytes
from tuner.cost.pipeline import in_flight, interleaved_order

if TYPE_CHECKING:
    from trainer.contract.devices import DeviceKind
    from tuner.perfconstants import ModelConstants

__all__ = [
    "PARTS",
    "activation_bytes_per_token",
    "interleaved_order",
    "memory",
    "model_state_bytes",
    "phase_bytes",
]


def memory(
    m: ModelConfig,
    p: ParallelConfig,
    precision: str,
    c: ModelConstants,
    device: DeviceKind = "gpu",
    moe_imbalance: float = 1.0,
) -> dict[str, float]:
    """Bytes on the fullest device of layout `p` of model `m` computing in `precision`, on ranks
    of kind `device`, a mixture of experts at `moe_imbalance` (tuner.cost.memory.memory)."""
    return memory_model.memory(Case(m, p, precision, c, device=device, moe_imbalance=moe_imbalance))


def phase_bytes(
    m: ModelConfig,
    p: ParallelConfig,
    precision: str,
    c: ModelConstants,
    stage: int,
    device: DeviceKind = "gpu",
    moe_imbalance: float = 1.0,
) -> dict[str, dict[str, float]]:
    """Tensor bytes of the rank at pipeline coordinate `stage` at the peak of each phase of a step
    (tuner.cost.memory.phase_bytes)."""
    return memory_model.phase_bytes(
        Case(m, p, precision, c, device=device, moe_imbalance=moe_imbalance), stage
    )


# The names tests/tuner/test_memmodel.py and test_moe_model.py read, with their old signatures,
# until they price a Case.
_in_flight = in_flight
_layer_params = layer_params


def _rank(
    m: ModelConfig,
    p: ParallelConfig,
    precision: str,
    c: ModelConstants,
    stage: int,
    device: DeviceKind,
    moe_imbalance: float = 1.0,
) -> RankBytes:
    return rank_bytes(Case(m, p, precision, c, device=device, moe_imbalance=moe_imbalance), stage)
