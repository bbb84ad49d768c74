"""Parallel degrees, validated against the world size, and the DeviceMesh they span."""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainer.config import ParallelConfig

# Mesh axes outer to inner: tp (and its column axis tp_col) innermost so that its ranks are
# neighbours (same node, fastest links), pp outermost because it sends the least (torchtitan's
# order). The placement rule the planner shares: trainer/topology.py.
from trainer.topology import MESH_AXES


@dataclass(frozen=True)
class ParallelDims:
    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int
    tp_col: int = 1

    def __post_init__(self) -> None:
        product = self.pp * self.dp_replicate * self.dp_shard * self.tp * self.tp_col
        if product != self.world_size:
            raise ValueError(
                f"pp({self.pp}) * dp_replicate({self.dp_replicate}) * dp_shard({self.dp_shard}) "
                f"* tp({self.tp}) * tp_col({self.tp_col}) = {product} != WORLD_SIZE({self.world_size})"
            )

    @classmethod
    def from_config(cls, parallel: ParallelConfig, world_size: int) -> ParallelDims:
        return cls(
            parallel.pp, parallel.dp_replicate, parallel.dp_shard, parallel.tp, world_size, parallel.tp_col
        )

    @property
    def enabled_axes(self) -> tuple[str, ...]:
        return tuple(a for a in MESH_AXES if getattr(self, a) > 1)

    @property
    def dp_axes(self) -> tuple[str, ...]:
        return tuple(a for a in ("dp_replicate", "dp_shard") if getattr(self, a) > 1)

    @property
    def tensor_axes(self) -> tuple[str, ...]:
        """The tensor-parallel axes of degree > 1: row (tp), column (tp_col), or both."""
        return tuple(a for a in ("tp", "tp_col") if getattr(self, a) > 1)

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """A mesh over the axes with degree > 1 (None on one rank)."""
        axes = self.enabled_axes
        if not axes:
            return None
        return init_device_mesh(device_type, tuple(getattr(self, a) for a in axes), mesh_dim_names=axes)
