"""HSDP in the search space and the model (issue 37), and data parallelism's bytes by dtype:
a study lists HSDP's replica counts (space.dp_replicate), each sharding over dp / dp_replicate
ranks with ZeRO > 0; the model prices the shard group's gathers and reduce-scatters on its link and
the shard's gradient all-reduced over the replicas on theirs (tuner/cost/data.py), the gradients'
bytes in the reduce dtype and the parameters' in the compute dtype."""

from __future__ import annotations

import math

import pytest

from trainer.contract.parallel import ParallelConfig
from trainer.contract.presets import MODEL_PRESETS
from tuner.cost.case import Case
from tuner.cost.collectives import ring_allreduce_s
from tuner.cost.data import data_part
from tuner.cost.layer import layer_params
from tuner.hardware import cluster_preset
from tuner.perfmodel import estimate
from tuner.space import RULE_HSDP_ZERO, SearchSpace
from tuner.spec import ClusterSpec, SpaceSpec

LLAMA_70B = MODEL_PRESETS["llama3.1-70b"]
H100 = ClusterSpec(**{**cluster_preset("h100-80gb"), "num_nodes": 4})  # 32 GPUs, 8 a node


def test_a_study_searches_hsdp_replicas_it_lists() -> None:
    space = SpaceSpec(tp=[8], pp=[1], dp_replicate=[1, 2], zero_stage=[0, 3], micro_batch_size=[1],
                      activation_checkpoint=["full"], sequence_parallel=[True], cp=[1])  # fmt: skip
    result = SearchSpace(LLAMA_70B, 32, 8, 64, space).enumerate()
    assert set(result.valid) == {
        ParallelConfig(tp=8, dp_replicate=4, num_microbatches=16, activation_checkpoint="full", sequence_parallel=True),
        ParallelConfig(tp=8, dp_shard=4, zero_stage=3, num_microbatches=16, activation_checkpoint="full",
                       sequence_parallel=True),
        ParallelConfig(tp=8, dp_replicate=2, dp_shard=2, zero_stage=3, num_microbatches=16,
                       activation_checkpoint="full", sequence_parallel=True),
    }  # fmt: skip
    # replicas without sharding are plain data parallelism, already listed: refused with the reason
    assert result.rejected[RULE_HSDP_ZERO] == 1
    assert "zero_stage 2 or 3" in result.examples[RULE_HSDP_ZERO]
    # the default space shards over the whole dp, as before
    default = SearchSpace(LLAMA_70B, 32, 8, 64, SpaceSpec(tp=[8], pp=[1])).enumerate().valid
    assert all(c.dp_replicate == 1 or c.zero_stage == 0 for c in default)


def _case(p: ParallelConfig, grad_reduce_dtype: str = "fp32") -> Case:
    return Case.priced(LLAMA_70B, p, H100, "bf16", grad_reduce_dtype=grad_reduce_dtype)


def test_hsdp_shards_within_a_node_and_all_reduces_the_shard_over_the_replicas() -> None:
    """tp 1, dp 32 = 4 replicas x 8 shards: the shard group is a node (NVLink), the replicas one
    rank a node apart (the network). Weights, gradients and Adam state over 8, not 32."""
    fsdp = ParallelConfig(dp_shard=32, zero_stage=2, micro_batch_size=1, num_microbatches=2,
                          activation_checkpoint="full")  # fmt: skip
    hsdp = ParallelConfig(dp_replicate=4, dp_shard=8, zero_stage=2, micro_batch_size=1, num_microbatches=2,
                          activation_checkpoint="full")  # fmt: skip
    f, h = (
        data_part(_case(fsdp), LLAMA_70B.num_layers, 2.0),
        data_part(_case(hsdp), LLAMA_70B.num_layers, 2.0),
    )
    assert f.comm.intra == 0 and f.comm.inter > 0  # 32 ranks on 4 nodes: the network
    assert h.comm.intra > 0 and h.comm.inter > 0
    # the replicas' share by hand: per reduce-scatter (one a micro-batch: ZeRO-2 without a
    # pipeline) the shard's fp32 gradient all-reduced over 4 ranks 8 apart, one call a layer
    case = _case(hsdp)
    params = LLAMA_70B.num_layers * layer_params(LLAMA_70B, 1) + 2.0 * case.model.vocab_size * 8192
    replica = ring_allreduce_s(params * 4 / 8, 4, case.link(4, 8), case.constants)
    assert h.comm.inter >= 2 * replica
    assert h.comm.inter < 2 * replica * 1.05  # the rest: one call a layer and reduce-scatter
    # memory: the model states over the shard group
    mem = {name: estimate(LLAMA_70B, p, H100).memory_bytes for name, p in (("fsdp", fsdp), ("hsdp", hsdp))}
    assert mem["hsdp"] > mem["fsdp"] + 8 * LLAMA_70B.num_params * (1 / 8 - 1 / 32) * 0.99


def test_gradients_are_reduced_in_the_reduce_dtype_and_parameters_gathered_in_the_compute_dtype() -> None:
    """Replicated data parallelism all-reduces its gradients: fp32 by default, so twice the bf16
    wire; ZeRO-3's parameter gathers stay bf16 whatever the gradients' dtype."""
    layers, share = LLAMA_70B.num_layers, 2.0
    replicated = ParallelConfig(tp=8, pp=8, dp_replicate=4, micro_batch_size=1, num_microbatches=8)
    fp32, bf16 = (data_part(_case(replicated, d), layers / 8, share / 8).comm.inter for d in ("fp32", "bf16"))
    case = _case(replicated)
    params = layers / 8 * layer_params(LLAMA_70B, 8) + share / 8 * case.model.vocab_size * 8192 / 8
    link = case.link(4, 64)
    wire = {b: ring_allreduce_s(params * b, 4, link, case.constants) for b in (2, 4)}
    assert fp32 - bf16 == pytest.approx(wire[4] - wire[2], rel=1e-9)
    sharded = ParallelConfig(dp_shard=32, zero_stage=3, micro_batch_size=1, num_microbatches=2,
                             activation_checkpoint="full")  # fmt: skip
    f32, b16 = (data_part(_case(sharded, d), layers, share).comm.inter for d in ("fp32", "bf16"))
    gathers, reduces = 2 * 2, 2  # ZeRO-3 without a pipeline: two gathers and a reduce-scatter a micro-batch
    case = _case(sharded)
    params = layers * layer_params(LLAMA_70B, 1) + share * case.model.vocab_size * 8192
    half = {b: ring_allreduce_s(params * b, 32, case.link(32, 1), case.constants) / 2 for b in (2, 4)}
    assert f32 - b16 == pytest.approx(reduces * (half[4] - half[2]), rel=1e-9)
    assert math.isclose(
        b16 - (gathers + reduces) * half[2], f32 - gathers * half[2] - reduces * half[4], rel_tol=1e-9
    )
