"""Parallel degrees, validated against the world size, and the DeviceMesh they span."""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainer.contract.parallel import ParallelConfig

# Mesh axes outer to inner: tp (and its column axis tp_col) innermost so that its ranks are
# neighbours (same node, fastest links), cp next to it, pp outermost because it sends the least
# (torchtitan's order). The placement rule the planner shares: trainer/contract/topology.py.
from trainer.contract.topology import MESH_AXES


@dataclass(frozen=True)
class ParallelDims:
    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int
    tp_col: int = 1
    ep: int = (
        1  # folded into dp x cp x tp: not a factor of the world (trainer/contract/topology.py expert_groups)
    )
    cp: int = 1

    def __post_init__(self) -> None:
        product = math.prod(getattr(self, a) for a in MESH_AXES)
        if product != self.world_size:
            factors = " * ".join(f"{a}({getattr(self, a)})" for a in MESH_AXES)
            raise ValueError(f"{factors} = {product} != WORLD_SIZE({self.world_size})")
        if self.stage_size % self.ep:
            raise ValueError(
                f"ep({self.ep}) must divide dp_replicate({self.dp_replicate}) * dp_shard({self.dp_shard}) "
                f"* cp({self.cp}) * tp({self.tp}) * tp_col({self.tp_col})"
            )

    @classmethod
    def from_config(cls, parallel: ParallelConfig, world_size: int) -> ParallelDims:
        return cls(**{a: getattr(parallel, a) for a in MESH_AXES}, ep=parallel.ep, world_size=world_size)

    @property
    def stage_size(self) -> int:
        """Ranks of one pipeline stage: dp x cp x tp (x tp_col)."""
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.tp_col

    @property
    def edp(self) -> int:
        """Expert data parallelism: ranks of one pipeline stage holding the same experts."""
        return self.stage_size // self.ep

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
        """A mesh over the axes with degree > 1 (None on one rank). With cp > 1 the ranks holding
        the same weights get a flattened axis of their own (torchtitan's "dp_shard_cp"):
        "dp_shard_cp" (dp_shard x cp, FSDP2's shards) when dp_shard > 1, else "dp_cp"
        (dp_replicate x cp, replicated) when dp_replicate > 1; with cp alone it is "cp"."""
        axes = self.enabled_axes
        if not axes:
            return None
        mesh = init_device_mesh(device_type, tuple(getattr(self, a) for a in axes), mesh_dim_names=axes)
        if self.cp > 1 and self.dp_shard > 1:
            mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        elif self.cp > 1 and self.dp_replicate > 1:
            mesh["dp_replicate", "cp"]._flatten("dp_cp")
        if self.cp > 1 and self.tp > 1:  # the ranks of one sequence (a mixture of experts' aux loss)
            mesh["cp", "tp"]._flatten("cp_tp")
        return mesh

    @property
    def weight_axes(self) -> tuple[str, ...]:
        """The mesh axes over which ranks hold the same dense weights (FSDP2 / replicate's mesh):
        the dp axes, with cp folded in (build_mesh's flattened axes)."""
        if self.cp == 1:
            return self.dp_axes
        if self.dp_shard > 1:
            return ("dp_replicate", "dp_shard_cp") if self.dp_replicate > 1 else ("dp_shard_cp",)
        return ("dp_cp",) if self.dp_replicate > 1 else ("cp",)

    def build_sparse_mesh(self, device_type: str) -> DeviceMesh:
        """The experts' mesh over the same ranks: ("pp", "edp", "ep") = arange(world).reshape(pp,
        edp, ep), torchtitan's folding: ep takes the innermost ranks of each stage's dp x cp x tp
        block (tensor-parallel neighbours first), edp the rest; every axis kept, even of size 1."""
        mesh = init_device_mesh(device_type, (self.pp, self.edp, self.ep), mesh_dim_names=("pp", "edp", "ep"))
        mesh["edp", "ep"]._flatten("stage")  # every rank of a stage: dp x cp x tp
        return mesh
