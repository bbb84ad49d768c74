"""Where a layout's ranks sit: the one rule the trainer's mesh follows and the planner assumes.

Ranks are numbered in mesh order, `MESH_AXES` outermost first (pp, dp_replicate, dp_shard, cp,
tp, tp_col: tensor parallelism innermost and context parallelism next to it, torchtitan's order, with the column axis next to the row
axis as in AxoNN, so that a tp x tp_col group is one block of neighbours), and placed on nodes in blocks: rank r runs on node
r // ranks_per_node. That is Slurm's default task distribution (`--distribution=block`, which
the job scripts and steps ask for explicitly) and torchrun's on one node. So a group of an axis
is `size` ranks `stride` apart (stride = the product of the degrees inside it), and a tensor-
parallel group sits inside one node whenever tp (x tp_col) divides the ranks per node.

The trainer checks the placement it got against this rule and records it in its result
(trainer/benchmark.py); the performance model prices each group at the link of the tier it spans
(tuner/perfmodel.py). Torch-free: the tuner imports it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from trainer.contract.axes import MESH_AXES  # outer to inner: the axis table's mesh_order
from trainer.contract.parallel import ParallelConfig


def axis_sizes(p: ParallelConfig) -> dict[str, int]:
    return {axis: getattr(p, axis) for axis in MESH_AXES}


def axis_strides(p: ParallelConfig) -> dict[str, int]:
    """Rank distance between neighbours of each axis: tp_col 1, tp tp_col, cp t (the
    tensor-parallel ranks, t = tp x tp_col), dp_shard t x cp, dp_replicate t x cp x dp_shard, pp
    t x cp x dp. Groups spanning several axes: "dp" (both data-parallel axes, dp ranks at stride
    t x cp), with tp_col > 1 "tensor" (the row x column group: t neighbouring ranks), and with
    cp > 1 and dp > 1 "dp_cp" (the ranks holding the same weights: FSDP2's and the gradients'
    group, dp x cp ranks at stride t)."""
    sizes, strides, inner = axis_sizes(p), {}, 1
    for axis in reversed(MESH_AXES):
        strides[axis] = inner
        inner *= sizes[axis]
    return strides


def expert_groups(p: ParallelConfig) -> dict[str, tuple[int, int]]:
    """(size, stride) of the expert-parallel group ("ep": ep neighbouring ranks, the innermost of
    each pipeline stage's dp x cp x tp block) and of the expert data-parallel group ("edp": the
    dp x cp x tp / ep ranks holding the same experts, ep apart). The trainer's sparse mesh is
    arange(world).reshape(pp, edp, ep) (trainer/parallel_dims.py), torchtitan's folding."""
    return {"ep": (p.ep, 1), "edp": (p.edp, p.ep)}


def members_per_node(size: int, stride: int, ranks_per_node: int) -> int:
    """How many members of one group (`size` ranks `stride` apart, starting on a node's first
    rank) share its busiest node."""
    if stride >= ranks_per_node:
        return 1
    if ranks_per_node % stride == 0:
        return min(size, ranks_per_node // stride)
    counts: dict[int, int] = {}
    for k in range(size):
        node = k * stride // ranks_per_node
        counts[node] = counts.get(node, 0) + 1
    return max(counts.values())


def nodes_spanned(size: int, stride: int, ranks_per_node: int) -> int:
    """Nodes one group spans (1: inside a node)."""
    return math.ceil(size / members_per_node(size, stride, ranks_per_node))


def expected_spans(p: ParallelConfig, ranks_per_node: int) -> dict[str, int]:
    """Nodes a group of each axis of degree > 1 spans, by the rule; the data-parallel axes also as
    one group ("dp"), the row x column tensor-parallel group ("tensor") and the data x context
    group ("dp_cp")."""
    return {axis: nodes_spanned(*size_stride(p, axis), ranks_per_node) for axis in group_axes(p)}


def group_axes(p: ParallelConfig) -> list[str]:
    """The groups the placement rule covers: each axis of degree > 1, "dp" when dp > 1,
    "tensor" when tp_col > 1 and "dp_cp" when both dp and cp > 1."""
    sizes = axis_sizes(p)
    out = [a for a in MESH_AXES if sizes[a] > 1]
    out += (["dp"] if p.dp > 1 else []) + (["tensor"] if p.tp_col > 1 else [])
    return out + (["dp_cp"] if p.dp > 1 and p.cp > 1 else [])


def size_stride(p: ParallelConfig, axis: str) -> tuple[int, int]:
    """(ranks in one group, rank distance between its neighbours) of an axis or combined group."""
    if axis == "dp":
        return p.dp, p.cp * p.tp * p.tp_col
    if axis == "dp_cp":
        return p.dp * p.cp, p.tp * p.tp_col
    if axis == "tensor":
        return p.tp * p.tp_col, 1
    return axis_sizes(p)[axis], axis_strides(p)[axis]


def groups(p: ParallelConfig, axis: str) -> list[list[int]]:
    """The ranks of every group of `axis` (or "dp": both data-parallel axes; "tensor": row x
    column; "dp_cp": data x context), in mesh order."""
    size, stride = size_stride(p, axis)
    span = size * stride
    return [[block + offset + k * stride for k in range(size)]
            for block in range(0, p.world_size, span) for offset in range(stride)]  # fmt: skip


def placement(p: ParallelConfig, hosts: Sequence[str]) -> dict:
    """What the trainer got, checked against the rule. `hosts[r]` is rank r's host name. Returns
    {"hosts": {host: [ranks]}, "ranks_per_node", "axes": {axis: {"size", "stride", "nodes",
    "expected_nodes"}}, "follows_rule", "tp_inside_node"}: `nodes` is the most nodes a group of
    that axis spans in this run, `expected_nodes` what the rule says for block placement."""
    by_host: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        by_host.setdefault(host, []).append(rank)
    per_node = max(len(r) for r in by_host.values())
    expected = expected_spans(p, per_node)
    axes = {}
    for axis, want in expected.items():
        got = max(len({hosts[r] for r in g}) for g in groups(p, axis))
        size, stride = size_stride(p, axis)
        axes[axis] = {"size": size, "stride": stride, "nodes": got, "expected_nodes": want}
    blocks = all(hosts[r] == hosts[(r // per_node) * per_node] for r in range(len(hosts)))
    return {
        "hosts": by_host, "ranks_per_node": per_node, "axes": axes,
        "follows_rule": blocks and all(a["nodes"] == a["expected_nodes"] for a in axes.values()),
        "tp_inside_node": axes.get("tensor", axes.get("tp", {})).get("nodes", 1) == 1,
    }  # fmt: skip


def summary(placement_: Mapping) -> str:
    """'2 nodes x 2 ranks; tp 1 node, pp 2 nodes' for logs and tables."""
    axes = ", ".join(
        f"{a} {v['nodes']} node{'s' if v['nodes'] > 1 else ''}" for a, v in placement_["axes"].items()
    )
    return f"{len(placement_['hosts'])} nodes x {placement_['ranks_per_node']} ranks" + (
        f"; {axes}" if axes else ""
    )
