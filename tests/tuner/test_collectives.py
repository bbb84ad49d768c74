"""Collectives priced from their parts (tuner/cost/collectives.py): the measured call cost by path,
ranks per core and group size, the bytes by tier, and the wait behind the compute."""

from __future__ import annotations

import dataclasses
import json

import pytest

from trainer.contract.parallel import ParallelConfig
from trainer.contract.presets import MODEL_PRESETS
from tuner.cost import collectives
from tuner.hardware import cluster_preset
from tuner.perfconstants import CPU_CONSTANTS, ModelConstants
from tuner.perfmodel import estimate
from tuner.spec import ClusterSpec

SMALL = MODEL_PRESETS["gpt-small"]


def cpu_ranks(cores: float = 2, **links: float) -> ClusterSpec:
    """8 gloo ranks on one node of `cores` cores, as the own 8-rank tables ran (4 per core)."""
    return ClusterSpec(
        **{**cluster_preset("cpu-local"), "gpus_per_node": 8, "cores_per_node": cores, **links}
    )


def free_wire(cores: float = 2) -> ClusterSpec:
    """Bytes cost nothing: only the per-call parts and the wait are left."""
    return cpu_ranks(cores, intra_node_gbps=1e9, inter_node_gbps=1e9)


def measured(path: str) -> list[tuple[float, int, float]]:
    return [(r, g, s) for k, r, g, s in CPU_CONSTANTS.cpu_call_s if k == path]


def test_a_collective_on_cpu_ranks_costs_what_gloo_groups_measured() -> None:
    """Each measured point of bench/gloo_groups.py is what the model charges for that call, and
    1D tensor parallelism pays, per Megatron collective, gloo's call and the DTensor path's."""
    assert measured("gloo") and measured("dtensor") and measured("fsdp")
    for path in ("gloo", "dtensor", "replicate", "fsdp"):
        scale = 1.0 if path == "gloo" else CPU_CONSTANTS.framework_call_scale  # the framework's, fitted
        for rpc, g, s in measured(path):
            assert collectives.call_overhead_s(g, CPU_CONSTANTS, rpc, path) == pytest.approx(scale * s)
    p = ParallelConfig(tp=2, dp_replicate=4, micro_batch_size=1, num_microbatches=4)
    e = estimate(SMALL, p, free_wire(), "fp32", CPU_CONSTANTS)
    per_call = collectives.call_overhead_s(2, CPU_CONSTANTS, 4.0) + collectives.call_overhead_s(
        2, CPU_CONSTANTS, 4.0, "dtensor"
    )
    calls = p.num_microbatches * SMALL.num_layers * 4  # 2 forward, 2 backward per layer
    assert e.tp_comm_s == pytest.approx(calls * per_call, rel=1e-6)


def test_a_pair_costs_far_less_than_a_group_of_eight() -> None:
    """gloo_groups: a pair's call is a fraction of a ms on 4 ranks per core, a group of 8 several
    ms; the log2 form (1 : 3) charged pairs ~9 ms and so priced 2D's pair collectives 1.5-2x
    too dear. Between measured sizes the cost is interpolated, beyond them extrapolated."""
    pair, four, eight = (collectives.call_overhead_s(g, CPU_CONSTANTS, 4.0) for g in (2, 4, 8))
    assert pair < 1e-3 and eight > 5 * pair and pair < four < eight
    assert (
        four
        < collectives.call_overhead_s(6, CPU_CONSTANTS, 4.0)
        < eight
        < collectives.call_overhead_s(16, CPU_CONSTANTS, 4.0)
    )


def test_measured_call_costs_interpolate_in_group_size_and_ranks_per_core() -> None:
    c = ModelConstants(cpu_call_s=(("gloo", 1, 2, 1.0), ("gloo", 4, 2, 2.0), ("gloo", 4, 4, 6.0)))
    assert collectives.call_overhead_s(3, c, 4.0) == pytest.approx(4.0)  # halfway between 2 and 4
    assert collectives.call_overhead_s(6, c, 4.0) == pytest.approx(10.0)  # along the last two
    assert collectives.call_overhead_s(4, c, 1.0) == pytest.approx(3.0)  # one size measured: per peer
    assert collectives.call_overhead_s(2, c, 2.5) == pytest.approx(1.5)  # halfway between 1 and 4 per core
    assert collectives.call_overhead_s(2, c, 8.0) == collectives.call_overhead_s(
        2, c, 4.0
    )  # beyond: the nearest
    assert (
        collectives.call_overhead_s(1, c, 4.0) == 0.0
        and collectives.call_overhead_s(2, c, 4.0, "fsdp") == 0.0
    )


def test_gpus_keep_nccls_log2_call_and_pay_no_framework_cost() -> None:
    """The GPU path is unchanged: collective_overhead_s per log2 round, the link latency per
    hop; DTensor's and FSDP2's Python run ahead of the kernels (layer_floor_s) and cost nothing."""
    c = ModelConstants()
    assert collectives.call_overhead_s(8, c, 0.0) == pytest.approx(3 * c.collective_overhead_s)
    assert (
        collectives.call_overhead_s(8, c, 0.0, "dtensor")
        == collectives.call_overhead_s(8, c, 0.0, "fsdp")
        == 0.0
    )
    a100 = ClusterSpec(**{**cluster_preset("a100-80gb"), "num_nodes": 2})
    for link in (collectives.group_link(a100, 8, 1), collectives.group_link(a100, 16, 1)):
        assert link.hop_latency_us(c) == link.latency_us
        assert link.rate_gbps(c) == pytest.approx(link.gbps * c.comm_efficiency)


def test_cpu_ranks_move_bytes_at_the_cores_rate_and_a_shaped_wire_at_its_own() -> None:
    """gloo copies and sums every byte on the ranks' cores: on one node at comm_efficiency of the
    node's link; across a wire slower than that, at the wire's nominal rate (the shaped 200 Mbit/s
    link measured 24 of 25 MB/s, docs/benchmarks.md)."""
    c = CPU_CONSTANTS
    fields = {**cluster_preset("cpu-local"), "gpus_per_node": 2, "cores_per_node": 0.5, "num_nodes": 4}
    shaped = ClusterSpec(**{**fields, "inter_node_gbps": 0.025, "inter_node_latency_us": 80.0})
    on_node, across = collectives.group_link(shaped, 2, 1), collectives.group_link(shaped, 4, 1)
    assert (on_node.tier, across.tier) == ("intra", "inter")
    assert on_node.rate_gbps(c) == pytest.approx(2.0 * c.comm_efficiency)
    assert across.rate_gbps(c) == 0.025  # the wire's nominal rate, not comm_efficiency of it
    # the measured call holds the on-node hops; a slower tier's extra latency is added per hop
    assert on_node.hop_latency_us(c) == 0.0
    assert across.hop_latency_us(c) == pytest.approx(80.0 - shaped.intra_node_latency_us)
    # without a measured table (a calibration stored before it) every hop pays the link's latency
    old = dataclasses.replace(c, cpu_call_s=())
    assert on_node.hop_latency_us(old) == shaped.intra_node_latency_us


def test_the_wait_is_priced_per_compute_segment_not_per_collective() -> None:
    """Ranks sharing cores wait for their group's slowest member behind the compute before a
    blocking collective: a fraction of that compute, whatever the calls cost; none without
    tensor parallelism (nothing blocks inside a layer) and none on a core per rank."""
    c = dataclasses.replace(CPU_CONSTANTS, layer_floor_s=0.0,
                            cpu_call_s=tuple(e for e in CPU_CONSTANTS.cpu_call_s if e[0] != "dtensor"))  # fmt: skip
    tp = ParallelConfig(tp=2, dp_replicate=4, micro_batch_size=1, num_microbatches=4)
    base = estimate(SMALL, tp, free_wire(), "fp32", c)
    assert base.terms.collective_wait_s == pytest.approx(c.collective_wait_fraction * base.compute_s)
    dear = dataclasses.replace(c, cpu_call_s=tuple((k, r, g, 10 * s) for k, r, g, s in c.cpu_call_s))
    e = estimate(SMALL, tp, free_wire(), "fp32", dear)
    assert e.tp_comm_s > 5 * base.tp_comm_s
    assert e.terms.collective_wait_s == pytest.approx(base.terms.collective_wait_s)
    slow = free_wire().model_copy(update={"peak_tflops": free_wire().peak_tflops / 2})
    slower = estimate(SMALL, tp, slow, "fp32", c).terms.collective_wait_s
    assert slower == pytest.approx(2 * base.terms.collective_wait_s)
    assert (
        estimate(SMALL, tp, free_wire(cores=8), "fp32", c).terms.collective_wait_s == 0.0
    )  # a core per rank
    dp = ParallelConfig(dp_replicate=8, micro_batch_size=1, num_microbatches=2)
    assert estimate(SMALL, dp, free_wire(), "fp32", c).terms.collective_wait_s == 0.0


def test_2d_tensor_parallelism_pays_no_dtensor_cost() -> None:
    """trainer/tp2d.py computes on local tensors with plain all-reduces: its calls pay gloo's
    cost only, which is why its many pair collectives are cheap."""
    p = ParallelConfig(tp=2, tp_col=2, dp_replicate=2, micro_batch_size=1, num_microbatches=1)
    without = dataclasses.replace(
        CPU_CONSTANTS, cpu_call_s=tuple(e for e in CPU_CONSTANTS.cpu_call_s if e[0] != "dtensor")
    )
    assert estimate(SMALL, p, cpu_ranks(), "fp32", CPU_CONSTANTS) == estimate(
        SMALL, p, cpu_ranks(), "fp32", without
    )


def test_constants_survive_a_json_round_trip() -> None:
    """Calibrations are stored as JSON (tuner/store): the measured table comes back as tuples."""
    assert ModelConstants(**json.loads(json.dumps(CPU_CONSTANTS.to_dict()))) == CPU_CONSTANTS


def test_dedicated_devices_wait_for_nothing_and_pay_no_framework_call() -> None:
    """On GPUs nothing is shared: no wait term, and every collective's price is NCCL's log2 form
    (what the model charged before the parts were split out)."""
    a100 = ClusterSpec(**{**cluster_preset("a100-80gb"), "num_nodes": 2})
    c = ModelConstants()
    for p in (
        ParallelConfig(tp=8, dp_replicate=2, micro_batch_size=1, num_microbatches=4),
        ParallelConfig(tp=4, tp_col=2, dp_replicate=2, micro_batch_size=1, num_microbatches=4),
    ):
        e = estimate(MODEL_PRESETS["gpt-1.3b"], p, a100, "bf16", c)
        assert e.terms.collective_wait_s == 0.0 and e.tp_comm_s > 0.0


@pytest.mark.slow  # a least-squares fit over every dev table: 20 s
def test_the_cpu_defaults_are_the_fit_and_the_2d_table_is_kept_out_of_it() -> None:
    """CPU_CONSTANTS are a least-squares fit (`bench/priors.py --fit-cpu-defaults`) on the dev tables
    only: the held-out 2D and gpt-deep tables judge the result, never feed it. The fit's objective
    has near-equal minima (elementwise_flops_per_byte trades against compute_efficiency): scipy
    1.17 stops at the digits written down, scipy 1.11 (the floor) at compute_efficiency 0.90 and
    elementwise_flops_per_byte 7.0, a 0.2 % lower rms. So the check is the fit, not the digits:
    no fresh fit fits the dev tables more than 1 % better than the committed constants."""
    from bench import priors
    from bench.validation_data import load_csv
    from tuner.fitting import rms_log_error

    assert not any("column" in name or "deep" in name for name in priors.CPU_DEFAULT_TABLES)
    assert {"collective_wait_fraction", "framework_call_scale"} <= set(priors.CPU_DEFAULT_FITTED)
    assert "collective_overhead_s" not in priors.CPU_DEFAULT_FITTED  # measured on CPU ranks, not fitted
    fitted = priors.fit_cpu_defaults()
    assert fitted.cpu_call_s == CPU_CONSTANTS.cpu_call_s
    rows = [
        r for name in priors.CPU_DEFAULT_TABLES for r in load_csv(priors.ROOT / "bench" / "own_tables" / name)
    ]
    dev = [priors.inputs(r) for r in rows if r.status == "ok" and r.iteration_time_s]
    assert len(dev) == 144
    committed, fresh = rms_log_error(dev, CPU_CONSTANTS), rms_log_error(dev, fitted)
    assert committed == pytest.approx(fresh, rel=0.01), (committed, fresh)
    # From the fit's starting point (the GPU defaults with the measured call costs) the dev tables
    # are fitted ~11x worse (rms 1.69 against 0.149): the committed constants are the fit's.
    start = rms_log_error(dev, dataclasses.replace(ModelConstants(), cpu_call_s=CPU_CONSTANTS.cpu_call_s,
                                                   collective_wait_fraction=0.5))  # fmt: skip
    assert committed < start / 3, (committed, start)


def test_the_held_out_2d_table_is_found_in_two_trials_from_a_cold_prior() -> None:
    """Issue 25's target: on own_gpt-small_4node_200mbit_column_gbs2 (2D tensor parallelism over a
    shaped 200 Mbit/s link; in no fit) the model sampler reaches a layout within 5 % of the best
    in <= 2 trials, median over 20 seeds (the log2 call cost needed 4; random needs 5)."""
    import statistics

    from bench import search_efficiency
    from bench.validation_data import load_csv

    rows = load_csv(search_efficiency.OWN_TABLES / "own_gpt-small_4node_200mbit_column_gbs2.csv")
    trials = [search_efficiency.search(rows, "model", seed)[0] for seed in range(20)]
    assert statistics.median(trials) <= 2
