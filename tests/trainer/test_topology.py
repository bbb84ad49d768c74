"""The placement rule (trainer/contract/topology.py) is the trainer's mesh and the planner's assumption:
its groups are the DeviceMesh's groups rank for rank (torch's fake process group, any world size
in one process), and the performance model prices each group at the tier the rule puts it on."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from trainer.contract.parallel import ParallelConfig as P
from trainer.contract.topology import axis_strides, expected_spans, groups, members_per_node, placement
from trainer.parallel_dims import ParallelDims
from tuner.cost.collectives import group_link
from tuner.hardware import cluster_preset
from tuner.spec import ClusterSpec

LAYOUTS = [
    P(tp=2, pp=2, dp_replicate=2, micro_batch_size=1, num_microbatches=2),
    P(tp=4, dp_shard=2, zero_stage=3),
    P(tp=2, pp=4, micro_batch_size=1, num_microbatches=4),
    P(pp=2, dp_replicate=2, dp_shard=2, zero_stage=2, micro_batch_size=1, num_microbatches=2),
    P(tp=8, pp=2, dp_shard=4, zero_stage=3, micro_batch_size=1, num_microbatches=2),
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda p: p.describe())
def test_the_rules_groups_are_the_trainers_mesh_groups(layout: P) -> None:
    world = layout.world_size
    for rank in sorted({0, 1, world // 2 + 1, world - 1}):
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
        try:
            dims = ParallelDims.from_config(layout, world)
            mesh = dims.build_mesh("cpu")
            for axis in dims.enabled_axes:
                mine = next(g for g in groups(layout, axis) if rank in g)
                assert dist.get_process_group_ranks(mesh.get_group(axis)) == mine, (axis, rank)
            if len(dims.dp_axes) > 1:  # the data-parallel axes together, as FSDP/HSDP reduce over them
                flat = mesh[dims.dp_axes]._flatten().get_group()
                assert sorted(dist.get_process_group_ranks(flat)) == next(
                    g for g in groups(layout, "dp") if rank in g
                )
        finally:
            dist.destroy_process_group()


def test_groups_partition_the_world_and_strides_follow_the_mesh_order() -> None:
    p = LAYOUTS[0]
    assert axis_strides(p) == {"tp_col": 1, "tp": 1, "cp": 2, "dp_shard": 2, "dp_replicate": 2, "pp": 4}
    for axis in ("pp", "dp_replicate", "tp", "dp"):
        ranks = sorted(r for g in groups(p, axis) for r in g)
        assert ranks == list(range(p.world_size)), axis


def test_block_placement_keeps_tp_inside_a_node_when_it_fits() -> None:
    p = LAYOUTS[0]  # tp 2 on nodes of 2 ranks: inside; pp and dp across
    assert expected_spans(p, ranks_per_node=2) == {"pp": 2, "dp_replicate": 2, "tp": 1, "dp": 2}
    hosts = [f"n{r // 2}" for r in range(8)]
    got = placement(p, hosts)
    assert got["follows_rule"] and got["tp_inside_node"]
    assert {a: v["nodes"] for a, v in got["axes"].items()} == {"pp": 2, "dp_replicate": 2, "tp": 1, "dp": 2}
    # Round-robin ranks (Slurm's --distribution=cyclic) break the rule: tp spans nodes.
    cyclic = placement(p, [f"n{r % 4}" for r in range(8)])
    assert not cyclic["follows_rule"] and not cyclic["tp_inside_node"]
    # tp larger than a node: it must span nodes, by the rule too.
    wide = P(tp=4, dp_replicate=2)
    assert placement(wide, hosts)["axes"]["tp"] == {"size": 4, "stride": 1, "nodes": 2, "expected_nodes": 2}


def test_members_per_node_counts_uneven_nodes_exactly() -> None:
    assert members_per_node(4, 1, 8) == 4 and members_per_node(4, 8, 8) == 1
    assert members_per_node(4, 2, 3) == 2  # ranks 0, 2 | 4 | 6: two on the first node


@pytest.mark.parametrize(
    ("size", "stride", "inside"), [(2, 1, True), (4, 1, False), (2, 2, False), (8, 1, False)]
)
def test_the_model_prices_a_group_at_the_tier_the_rule_puts_it_on(
    size: int, stride: int, inside: bool
) -> None:
    # 4 nodes x 2 devices: 100 GB/s inside a node, 1 GB/s between nodes.
    cluster = ClusterSpec(**{**cluster_preset("a100-80gb"), "gpus_per_node": 2, "num_nodes": 4,
                             "intra_node_gbps": 100.0, "inter_node_gbps": 1.0})  # fmt: skip
    gbps = group_link(cluster, size, stride).gbps
    assert (gbps == 100.0) == inside
    assert (members_per_node(size, stride, 2) >= size) == inside
