"""Data parallelism's overlap priced from the trainer's order of operations (issue 37, item 3;
tuner/cost/data.py overlap_rule), no fitted fraction: on GPUs a chain of per-block collectives on
FSDP2's own streams, each hidden behind a block's compute but the first; a pipeline's reductions
at torch's REDUCE_GRAD after the last backward, all exposed; on CPU ranks every collective blocks.
What is hidden is reported apart (Estimate.hidden, `tuner plan --explain`), never in the terms."""

from __future__ import annotations

import pytest

from trainer.contract.parallel import ParallelConfig
from trainer.contract.presets import MODEL_PRESETS
from tuner.cost.case import Case
from tuner.cost.data import LayerTime, data_part
from tuner.cost.layer import layer_params
from tuner.hardware import cluster_preset
from tuner.perfmodel import estimate
from tuner.spec import ClusterSpec

LLAMA_8B = MODEL_PRESETS["llama3.1-8b"]
H100 = ClusterSpec(**{**cluster_preset("h100-80gb"), "num_nodes": 2})  # 16 GPUs, 8 a node
CPU = ClusterSpec(**cluster_preset("cpu-local"))
LAYERS = LLAMA_8B.num_layers


def _case(p: ParallelConfig, cluster: ClusterSpec = H100) -> Case:
    return Case.priced(LLAMA_8B, p, cluster, "bf16" if cluster is H100 else "fp32")


def test_a_replicated_reduction_under_ample_compute_shows_its_first_collective_only() -> None:
    """zero 0, no pipeline: the last micro-batch's backward all-reduces block by block; with each
    block's backward longer than its all-reduce, only the last one issued (the first block's) and
    the root's (embedding and head) are waited for."""
    p = ParallelConfig(dp_replicate=16, micro_batch_size=1, num_microbatches=4)
    case = _case(p)
    part = data_part(case, LAYERS, 1.0, LayerTime(forward_s=10.0, backward_s=20.0))
    comm = part.comm.total
    root = LLAMA_8B.vocab_size * LLAMA_8B.hidden_size  # vocab_share 1: one V x h matrix
    total = LAYERS * layer_params(LLAMA_8B, 1, 1) + root
    assert part.exposed.total == pytest.approx(comm * (root / total + (1 - root / total) / LAYERS), rel=0.02)
    assert part.exposed.total + part.hidden.total == pytest.approx(comm)
    # no compute to hide behind: the whole chain waits
    bare = data_part(case, LAYERS, 1.0, LayerTime())
    assert bare.exposed.total == pytest.approx(comm)


@pytest.mark.parametrize("zero", [0, 2, 3])
def test_a_pipeline_reduces_after_its_last_backward_with_nothing_to_hide_behind(zero: int) -> None:
    """The same stage with and without a pipeline, one micro-batch: pp 1 reduces block by block
    under the backward; pp 2 at REDUCE_GRAD after it, the whole reduction exposed."""
    dp = {"dp_shard": 8, "zero_stage": zero} if zero else {"dp_replicate": 8}
    compute = LayerTime(forward_s=10.0, backward_s=20.0)
    shares = {}
    for pp in (1, 2):
        p = ParallelConfig(pp=pp, micro_batch_size=1, num_microbatches=1, **dp)
        part = data_part(_case(p), LAYERS / 2, 0.5, compute)
        shares[pp] = part.exposed.total / part.comm.total
    assert shares[2] > shares[1] * 3
    if zero == 0:  # replicated: one all-reduce, all of it waited for
        assert shares[2] == pytest.approx(1.0)
    else:  # the gathers still hide behind the forward's blocks
        assert shares[2] < 1.0


def test_a_chain_longer_than_the_compute_shows_what_each_collective_exceeds_it_by() -> None:
    """ZeRO-3: every micro-batch gathers in its forward and gathers and reduces in its backward;
    with blocks computing in half a collective's time, each later collective shows the other half."""
    p = ParallelConfig(dp_shard=16, zero_stage=3, micro_batch_size=1, num_microbatches=2)
    case = _case(p)
    bare = data_part(case, LAYERS, 1.0, LayerTime())  # nothing hides: the whole of it
    assert bare.exposed.total == pytest.approx(bare.comm.total)
    huge = data_part(case, LAYERS, 1.0, LayerTime(1e3, 2e3))  # every block hides its collective
    tight = data_part(case, LAYERS, 1.0, LayerTime(forward_s=0.0, backward_s=1e3))  # forwards hide none
    assert huge.exposed.total < tight.exposed.total < bare.exposed.total
    # the chain's form: with blocks computing x, a collective of c > x shows c - x
    waits = [data_part(case, LAYERS, 1.0, LayerTime(x, 2 * x)).exposed.total for x in (0.0, 1e-4, 2e-4)]
    assert waits[0] - waits[1] == pytest.approx(waits[1] - waits[2], rel=1e-6)  # linear while c > x


def test_cpu_ranks_hide_nothing() -> None:
    """FSDP2 on CPU: its streams are the calling thread's, every collective blocks."""
    p = ParallelConfig(dp_shard=4, zero_stage=2, micro_batch_size=1, num_microbatches=2)
    model = MODEL_PRESETS["gpt-tiny"]
    case = Case.priced(model, p, CPU, "fp32")
    part = data_part(case, model.num_layers, 1.0, LayerTime(1.0, 2.0))
    assert part.exposed == part.comm
    assert estimate(model, p, CPU, "fp32").hidden == {}


def test_the_estimate_reports_what_is_hidden_apart_from_the_terms() -> None:
    p = ParallelConfig(
        dp_shard=16, zero_stage=3, micro_batch_size=1, num_microbatches=8, activation_checkpoint="full"
    )
    est = estimate(LLAMA_8B, p, H100, "bf16")
    assert est.hidden.get("dp_comm_intra_s", 0) + est.hidden.get("dp_comm_inter_s", 0) > 0
    exposed = est.terms.dp_comm_intra_s + est.terms.dp_comm_inter_s
    case = _case(p)
    whole = data_part(case, LAYERS, 2.0).comm.total  # what FSDP2 moves: blocks, embedding, head
    assert exposed + sum(v for k, v in est.hidden.items() if k.startswith("dp_")) == pytest.approx(whole)
    assert est.step_time_s == pytest.approx(est.terms.total_s)  # hidden is not in the step


def test_a_plan_says_which_formats_can_run_its_pick() -> None:
    """tuner.exports.refusals: each export format's reason to refuse a layout (none: it can)."""
    from tuner.exports import refusals
    from tuner.spec import parse_spec

    spec = parse_spec({"name": "r", "model": "llama3.1-8b", "cluster": {"preset": "h100-80gb", "num_nodes": 1},
                       "num_gpus": 8, "training": {"global_batch_size": 8, "seq_len": 65536}})  # fmt: skip
    plain = ParallelConfig(dp_shard=8, zero_stage=3, micro_batch_size=1, activation_checkpoint="full")
    assert refusals(spec, plain) == {}
    offload = ParallelConfig(dp_shard=8, zero_stage=3, micro_batch_size=1, activation_checkpoint="offload")
    refused = refusals(spec, offload)
    assert set(refused) == {"megatron", "torchtitan"} and all("offload" in r for r in refused.values())


def test_zero2_without_a_pipeline_gathers_and_reduces_every_micro_batch() -> None:
    """As the trainer runs it (tests/trainer/test_gathers.py counts FSDP2's all-gathers): FSDP2
    reshards after each backward, so each micro-batch gathers a pass and reduce-scatters one."""
    comm = {}
    for mb in (1, 2, 4):
        p = ParallelConfig(dp_shard=16, zero_stage=2, micro_batch_size=1, num_microbatches=mb)
        comm[mb] = data_part(_case(p), LAYERS, 2.0).comm.total
    assert comm[2] == pytest.approx(2 * comm[1])
    assert comm[4] == pytest.approx(4 * comm[1])
