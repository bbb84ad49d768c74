"""The scale-up domain (ClusterSpec.scaleup_domain): devices joined by the fast fabric beyond a node,
as on a GB200 NVL72 rack (72 GPUs on trays of 4). Groups inside it talk at the fast link, the
space lets tp, ep and cp use it, and past it they cross the network; a cluster without one is a
node's 8 as before."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from trainer.contract.parallel import ParallelConfig
from trainer.contract.presets import MODEL_PRESETS
from tuner.cost.collectives import group_link
from tuner.perfconstants import ModelConstants
from tuner.perfmodel import estimate
from tuner.space import RULE_CROSS_NODE_EP, RULE_CROSS_NODE_TP, SearchSpace
from tuner.spec import ClusterSpec, SpaceSpec

TRAY = dict(gpus_per_node=4, num_nodes=18, device_memory_gb=192, peak_tflops=2500, intra_node_gbps=900,
            inter_node_gbps=4 * 50, intra_node_latency_us=3, inter_node_latency_us=8)  # fmt: skip


def test_a_domain_must_be_whole_nodes_and_names_the_field() -> None:
    with pytest.raises(
        ValidationError, match=r"scaleup_domain \(70\) must be a multiple of gpus_per_node \(4\)"
    ):
        ClusterSpec(**TRAY, scaleup_domain=70)
    assert ClusterSpec(**TRAY).domain_size == 4 and ClusterSpec(**TRAY, scaleup_domain=72).domain_size == 72


@pytest.mark.parametrize(("size", "stride", "domain", "tier"), [
    (8, 1, 72, "intra"),  # tp 8 over two trays of one rack
    (64, 1, 72, "intra"),  # ep 64 inside the rack
    (8, 1, None, "inter"),  # the same groups on trays joined only by the network
    (64, 1, None, "inter"),
    (144, 1, 72, "inter"),  # two racks
    (4, 32, 72, "inter"),  # dp of 4 ranks 32 apart: 128 ranks, past one rack's 72
    (2, 32, 72, "intra"),  # 2 ranks 32 apart: 64 ranks, inside one rack
])  # fmt: skip
def test_a_group_inside_the_domain_talks_at_the_fast_link(
    size: int, stride: int, domain: int | None, tier: str
) -> None:
    link = group_link(ClusterSpec(**TRAY, scaleup_domain=domain), size, stride)
    assert link.tier == tier
    assert (link.gbps == 900) is (tier == "intra")  # past the rack: a share of the trays' network


def test_the_space_places_tp_and_ep_within_the_domain() -> None:
    dense, moe = MODEL_PRESETS["llama3.1-70b"], MODEL_PRESETS["qwen3-30b-a3b"]
    only = SpaceSpec(tp=[8], pp=[1], micro_batch_size=[1], allow_cross_node_tp=False)
    tray = SearchSpace(dense, 64, 4, 256, only).enumerate()
    rack = SearchSpace(dense, 64, 4, 256, only, domain=72).enumerate()
    assert tray.rejected[RULE_CROSS_NODE_TP] > 0 and not tray.valid
    assert "tp (8) > gpus_per_node (4)" in tray.examples[RULE_CROSS_NODE_TP]
    assert not rack.rejected[RULE_CROSS_NODE_TP] and rack.valid
    experts = SpaceSpec(ep=[16], pp=[1], micro_batch_size=[1])
    assert SearchSpace(moe, 64, 4, 256, experts).enumerate().rejected[RULE_CROSS_NODE_EP] > 0
    assert SearchSpace(moe, 64, 4, 256, experts, domain=72).enumerate().valid
    wide = SearchSpace(
        moe, 144, 4, 288, SpaceSpec(ep=[128], pp=[1], micro_batch_size=[1]), domain=72
    ).enumerate()
    assert "ep (128) > scaleup_domain (72)" in wide.examples[RULE_CROSS_NODE_EP]


def test_a_rack_prices_tensor_parallelism_across_trays_as_one_node() -> None:
    """tp 8 on trays of 4: across the network without a domain, at NVLink inside NVL72's."""
    model = MODEL_PRESETS["llama3.1-70b"]
    p = ParallelConfig(tp=8, dp_shard=9, zero_stage=3, num_microbatches=8, sequence_parallel=True,
                       activation_checkpoint="full")  # fmt: skip
    c = ModelConstants()
    rack = estimate(model, p, ClusterSpec(**TRAY, scaleup_domain=72), "bf16", c)
    trays = estimate(model, p, ClusterSpec(**TRAY), "bf16", c)
    assert rack.terms.tp_comm_inter_s == 0 and rack.terms.tp_comm_intra_s > 0
    assert trays.terms.tp_comm_inter_s > 0 and rack.step_time_s < trays.step_time_s


def test_the_nvl72_presets_are_one_domain_of_72_and_the_plan_uses_it() -> None:
    """`tuner plan` on GB200 NVL72 (trays of 4): tp 8 and ep 16 stay on NVLink; B200's boards of 8
    are their own domain."""
    import json
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from tuner.hardware import cluster_preset

    nvl = ClusterSpec(**cluster_preset("gb200-nvl72"))
    assert (nvl.gpus_per_node, nvl.domain_size) == (4, 72)
    assert ClusterSpec(**cluster_preset("gb300-nvl72")).domain_size == 72
    assert ClusterSpec(**cluster_preset("b200")).domain_size == 8
    tuner = shutil.which("tuner", path=str(Path(sys.executable).parent)) or "tuner"
    run = subprocess.run([tuner, "plan", "--model", "llama3.1-70b", "--cluster", "gb200-nvl72", "--gpus", "64",
                          "--global-batch", "512", "--config", "tp=8", "--json", "--top", "5"],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr
    candidates = json.loads(run.stdout)["candidates"]
    assert candidates and all(c["config"]["tp"] == 8 for c in candidates)
    for c in candidates:  # 8 ranks on two trays: NVLink, not the trays' network
        assert c["predicted"]["terms"]["tp_comm_inter_s"] == 0 < c["predicted"]["terms"]["tp_comm_intra_s"]


@pytest.mark.parametrize(("preset", "size", "gbps"), [
    ("mi300x", 2, 64), ("mi300x", 4, 192), ("mi300x", 8, 448), ("mi355x", 2, 76.8), ("mi355x", 8, 537.6),
    ("h100-80gb", 2, 450), ("h100-80gb", 8, 450),  # NVSwitch: every pair at the full rate
])  # fmt: skip
def test_a_full_mesh_gives_a_group_its_links_to_the_others(preset: str, size: int, gbps: float) -> None:
    """AMD's boards are a mesh of pairwise Infinity Fabric links (ClusterSpec.intra_node_peer_gbps):
    a group of k ranks reaches k - 1 of them; an NVSwitch gives any group the whole rate."""
    from tuner.hardware import cluster_preset

    link = group_link(ClusterSpec(**cluster_preset(preset)), size, 1)
    assert link.tier == "intra" and link.gbps == pytest.approx(gbps)
