"""Data parallelism's part (replicated, or sharded: ZeRO / FSDP2), context parallelism's ranks
included (they hold the same weights: tuner/cost/context.py): in a step, the gradients' reduction,
ZeRO-3's parameter gathers and the AdamW step over the rank's shard; in memory, the model states
as ZeRO counts them (Rajbhandari et al. 2020, "ZeRO", SC'20).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tuner.cost import dtypes
from tuner.cost.collectives import Comm, call_overhead_s, ring_allreduce_s
from tuner.cost.experts import local_expert_params, moe_layer_dense_params, moe_layers_on
from tuner.cost.layer import layer_params

if TYPE_CHECKING:
    from tuner.cost.case import Case

# The AdamW step moves 28 bytes per parameter (read w, g, m, v; write w, m, v, fp32). In the units
# elementwise_flops_per_byte prices (a layer's stored activation bytes, each read and written
# several times by the ops around it) that weighs ~8: chosen among 0/8/16/28 on the vTrain h1024
# tables (uncalibrated error 7.4 / 6.6 / 6.9 / 8.2 %).
OPTIMIZER_BYTES_PER_PARAM = 8.0
DDP_BUCKET_BYTES = 25e6  # torch DDP's bucket_cap_mb default: ZeRO-1's gradients go in 25 MB all-reduces


@dataclass(frozen=True)
class DataPart:
    """Data parallelism's seconds in a step."""

    comm: Comm  # all of its collectives (what keeps a core busy)
    exposed: Comm  # ... not hidden behind backward
    optimizer_s: float  # the AdamW step over the rank's (shard of its) parameters

    def terms(self) -> dict[str, float]:
        return {
            "dp_comm_intra_s": self.exposed.intra,
            "dp_comm_inter_s": self.exposed.inter,
            "optimizer_s": self.optimizer_s,
        }


def data_part(case: Case, layers: float, vocab_share: float) -> DataPart:
    """Gradients all-reduced once per step; ZeRO/FSDP splits it into reduce-scatter + all-gather
    (same bytes, ZeRO sec. 7); ZeRO-3 gathers parameters for forward and again for backward of
    every micro-batch (1.5x, ZeRO sec. 7.2.2). `layers` and `vocab_share` (of the V x h
    parameters) are the rank's."""
    m, p, c = case.model, case.layout, case.constants
    h, t, pp, mb = m.hidden_size, p.tp, p.pp, p.num_microbatches
    d, tc, rpc = case.replicas, case.tp_block, case.ranks_per_core
    act_bytes = case.value_bytes
    moe_layers = moe_layers_on(m, layers) if m.moe else 0  # the experts' layers reduce apart (below)
    dp_link = case.link(d, tc)
    params_rank = layers * layer_params(m, t, p.tp_col) + vocab_share * m.vocab_size * h / tc
    expert_rank = 0.0
    if m.moe:  # MoE layers: their routed experts (E / ep a rank) reduce over edp, the rest over dp
        dense_layers = (layers - moe_layers) * layer_params(m, t, p.tp_col)
        moe_rest = moe_layers * moe_layer_dense_params(m, t)
        params_rank = dense_layers + moe_rest + vocab_share * m.vocab_size * h / tc
        expert_rank = moe_layers * local_expert_params(m, p.ep)
    # Gradients are reduced in the reduce dtype (FSDP2's and replicate's reduce_dtype: fp32 unless
    # grad_reduce_dtype bf16, as Megatron-LM reduces a bf16 model's in fp32 unless
    # --grad-reduce-in-bf16), parameters gathered in the compute dtype (FSDP2's param_dtype).
    reduce_bytes = reduce_value_bytes(case)
    if p.zero_stage == 3:  # gathers for forward and backward, a reduce-scatter a micro-batch (pp: one)
        gathers, reduces = 2 * mb, (mb if pp == 1 else 1)
    elif p.zero_stage == 2 and pp == 1:  # reduce-scatter every micro-batch, one all-gather
        gathers, reduces = 1, mb
    elif p.zero_stage == 0:  # an all-reduce of the gradients: both its halves in the reduce dtype
        gathers, reduces = 0, 2
    else:  # one reduce-scatter, one all-gather of the updated parameters
        gathers, reduces = 1, 1
    halves = gathers + reduces
    # FSDP2's HSDP: gathers and reduce-scatters within a shard group, then the shard's gradient
    # all-reduced over the replicas (mesh [dp_replicate, dp_shard x cp]: replicas dp_shard x cp x
    # tp ranks apart); otherwise the group is every replica
    hsdp = p.zero_stage > 0 and p.dp_replicate > 1
    group = p.dp_shard * p.cp if hsdp else d
    if hsdp:
        dp_link = case.link(group, tc)
    full_ar = ring_allreduce_s(params_rank * act_bytes, group, dp_link, c)  # a gather half x 2
    reduce_ar = ring_allreduce_s(params_rank * reduce_bytes, group, dp_link, c)  # a reduce half x 2
    # Collectives issued: sharded data parallelism (FSDP, ZeRO-2/3) one per layer and pass, so
    # halves x layers; replicated gradients the trainer's way (trainer/parallelize.py
    # apply_replicate: FSDP2's replicate per block and on the root, synced on the last micro-batch
    # only), one per layer plus the root's; ZeRO-1, which the trainer does not offer, one per
    # 25 MB bucket (DeepSpeed's and DDP's). Each pays the backend's call cost as tp's do and, on
    # CPU ranks, what FSDP2's Python adds per collective (bench/gloo_groups.py: a few ms there,
    # most of what ZeRO-3 and small replicated models cost).
    if p.zero_stage >= 2:
        n_dp_collectives = halves * layers
    elif p.zero_stage == 0:
        n_dp_collectives = math.ceil(layers) + 1
    else:
        n_dp_collectives = math.ceil(params_rank * act_bytes / DDP_BUCKET_BYTES)
    framework = "replicate" if p.zero_stage == 0 else "fsdp"  # FSDP2's replicate, or its sharding
    per_call = call_overhead_s(group, c, rpc) + call_overhead_s(group, c, rpc, framework)
    wire = (full_ar * gathers + reduce_ar * reduces) / 2
    dp_comm = Comm.on(dp_link.tier, wire + n_dp_collectives * per_call)
    if hsdp:  # each reduce pass: one all-reduce a layer (FSDP unit) over the replicas
        r = p.dp_replicate
        rep_link = case.link(r, tc * group)
        replica_ar = ring_allreduce_s(params_rank * reduce_bytes / group, r, rep_link, c)
        rep_call = call_overhead_s(r, c, rpc) + call_overhead_s(r, c, rpc, framework)
        dp_comm = dp_comm + Comm.on(rep_link.tier, reduces * (replica_ar + math.ceil(layers) * rep_call))
    if expert_rank and p.edp > 1:  # the experts' gradients over their own replicas (edp, stride ep)
        e_link = case.link(p.edp, p.ep)
        e_gather = ring_allreduce_s(expert_rank * act_bytes, p.edp, e_link, c)
        e_reduce = ring_allreduce_s(expert_rank * reduce_bytes, p.edp, e_link, c)
        n_e = halves * moe_layers if p.zero_stage >= 2 else math.ceil(moe_layers)
        e_call = call_overhead_s(p.edp, c, rpc) + call_overhead_s(p.edp, c, rpc, framework)
        e_wire = (e_gather * gathers + e_reduce * reduces) / 2
        dp_comm = dp_comm + Comm.on(e_link.tier, e_wire + n_e * e_call)
    dp_exposed = dp_comm * (1 - c.dp_overlap)

    # The optimizer step (AdamW) once per step over the rank's parameters, memory-bound like the
    # work between the GEMMs: it reads weights, gradients, m and v and writes weights, m and v.
    # ZeRO >= 1 shards it over dp; replicated, every data-parallel rank repeats it.
    opt_params = params_rank / (d if p.zero_stage >= 1 else 1)
    if expert_rank:
        opt_params += expert_rank / (p.edp if p.zero_stage >= 1 else 1)
    optimizer_s = (
        opt_params * OPTIMIZER_BYTES_PER_PARAM * c.elementwise_flops_per_byte / case.memory_peak_flops
    )
    return DataPart(dp_comm, dp_exposed, optimizer_s)


def reduce_value_bytes(case: Case) -> int:
    """Bytes of a gradient value as data parallelism reduces it: fp32 unless the study reduces in
    bf16 (BenchmarkConfig.grad_reduce_dtype), whatever the compute dtype."""
    return 2 if case.grad_reduce_dtype == "bf16" else 4


def model_state_bytes(
    num_params: float, precision: str, zero_stage: int, dp: int
) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes per device as ZeRO counts them (sec. 3.1:
    2 + 2 + 12 bytes per parameter in mixed precision, 4 + 4 + 8 in fp32; sec. 5: stage 1 divides
    the optimizer state by dp, stage 2 also the gradients, stage 3 also the weights). The trainer
    keeps its own split (fp32 master weights and gradients, bf16 copies while computing;
    tuner.cost.memory counts that one): the same 16 bytes between steps."""
    w = g = dtypes.value_bytes(precision)
    o = dtypes.adam_state_bytes(precision)
    return (
        num_params * w / (dp if zero_stage >= 3 else 1),
        num_params * g / (dp if zero_stage >= 2 else 1),
        num_params * o / (dp if zero_stage >= 1 else 1),
    )


def weight_shards(case: Case) -> int:
    """How many ways FSDP2 shards a rank's parameters (1: replicated): over dp_shard x cp."""
    p = case.layout
    return p.dp_shard * p.cp if p.zero_stage else 1


def expert_shards(case: Case) -> int:
    """How many ways FSDP2 shards a rank's routed experts: the expert data parallelism."""
    p = case.layout
    return p.edp if case.model.moe and p.zero_stage else 1  # a dense model has no experts to shard
