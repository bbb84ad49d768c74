"""The analytic memory model's entry point: bytes on a layout's fullest device as the trainer
(trainer/) holds them. The model is tuner/cost/memory.py (the assembly, and `phase_bytes`: a
rank's bytes by phase) over each axis's part (tuner/cost/layer.py, pipeline.py, data.py,
context.py, experts.py); this module keeps `memory` with the signature its callers use (the
fitting, the memory oracle's comparisons).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer.contract.model import ModelConfig
from trainer.contract.parallel import ParallelConfig
from tuner.cost import memory as memory_model
from tuner.cost.case import Case

if TYPE_CHECKING:
    from trainer.contract.devices import DeviceKind
    from tuner.perfconstants import ModelConstants

__all__ = ["memory"]


def memory(
    m: ModelConfig,
    p: ParallelConfig,
    precision: str,
    c: ModelConstants,
    device: DeviceKind = "gpu",
    moe_imbalance: float = 1.0,
    grad_reduce_dtype: str = "fp32",
) -> dict[str, float]:
    """Bytes on the fullest device of layout `p` of model `m` computing in `precision`, on ranks
    of kind `device`, a mixture of experts at `moe_imbalance`, gradients reduced and accumulated
    in `grad_reduce_dtype` (tuner.cost.memory.memory)."""
    return memory_model.memory(
        Case(
            m,
            p,
            precision,
            c,
            device=device,
            moe_imbalance=moe_imbalance,
            grad_reduce_dtype=grad_reduce_dtype,
        )
    )
