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
    exposed: Comm  # ... not hidden behind compute (overlap_rule: from the trainer's order)
    optimizer_s: float  # the AdamW step over the rank's (shard of its) parameters

    @property
    def hidden(self) -> Comm:
        return self.comm + self.exposed * -1.0

    def terms(self) -> dict[str, float]:
        return {
            "dp_comm_intra_s": self.exposed.intra,
            "dp_comm_inter_s": self.exposed.inter,
            "optimizer_s": self.optimizer_s,
        }


@dataclass(frozen=True)
class LayerTime:
    """One layer's forward and backward (recompute in it) on the compute stream, one micro-batch,
    everything that blocks it (tuner/cost/step.py): what a data-parallel collective on its own
    stream can hide behind."""

    forward_s: float = 0.0
    backward_s: float = 0.0


def data_part(case: Case, layers: float, vocab_share: float, layer: LayerTime | None = None) -> DataPart:
    """Gradients all-reduced once per step; ZeRO/FSDP splits it into reduce-scatter + all-gather
    (same bytes, ZeRO sec. 7); ZeRO-3 gathers parameters for forward and again for backward of
    every micro-batch (1.5x, ZeRO sec. 7.2.2). `layers` and `vocab_share` (of the V x h
    parameters) are the rank's; `layer` its layers' compute, which hides what overlap_rule says
    (None: nothing hidden)."""
    m, p, c = case.model, case.layout, case.constants
    h, t, pp, mb = m.hidden_size, p.tp, p.pp, p.num_microbatches
    d, tc, rpc = case.replicas, case.tp_block, case.ranks_per_core
    act_bytes = case.value_bytes
    moe_layers = moe_layers_on(m, layers) if m.moe else 0  # the experts' layers reduce apart (below)
    dp_link = case.link(d, tc)
    root_params = vocab_share * m.vocab_size * h / tc  # the root module's: embedding and head
    params_rank = layers * layer_params(m, t, p.tp_col) + root_params
    expert_rank = 0.0
    if m.moe:  # MoE layers: their routed experts (E / ep a rank) reduce over edp, the rest over dp
        dense_layers = (layers - moe_layers) * layer_params(m, t, p.tp_col)
        moe_rest = moe_layers * moe_layer_dense_params(m, t)
        params_rank = dense_layers + moe_rest + root_params
        expert_rank = moe_layers * local_expert_params(m, p.ep)
    # Gradients are reduced in the reduce dtype (FSDP2's and replicate's reduce_dtype: fp32 unless
    # grad_reduce_dtype bf16, as Megatron-LM reduces a bf16 model's in fp32 unless
    # --grad-reduce-in-bf16), parameters gathered in the compute dtype (FSDP2's param_dtype).
    reduce_bytes = reduce_value_bytes(case)
    # Passes over the rank's parameters as FSDP2 runs them in the trainer (torch 2.13): it
    # reshards after each forward (ZeRO-3's reshard_after_forward) and after each backward (its
    # default) unless told not to. Without a pipeline, ZeRO-3 gathers for every forward and
    # backward, ZeRO-2 for every forward (resharded by the backward before), and both
    # reduce-scatter every micro-batch. With one, torch's stage keeps parameters gathered after a
    # backward and reduces once at REDUCE_GRAD: ZeRO-2 gathers once; ZeRO-3 gathers before a
    # forward or backward that follows a forward (1F1B: the warm-up forwards and the first
    # steady one, then each steady backward: m + 1 in all, whatever the warm-up).
    if p.zero_stage == 3:
        gathers, reduces = (2 * mb, mb) if pp == 1 else (mb + 1, 1)
    elif p.zero_stage == 2 and pp == 1:  # a gather and a reduce-scatter every micro-batch
        gathers, reduces = mb, mb
    elif p.zero_stage == 0:  # one all-reduce of the gradients: both its halves in the reduce dtype
        gathers, reduces = 0, 1
    else:  # one reduce-scatter, one all-gather of the updated parameters
        gathers, reduces = 1, 1
    # FSDP2's HSDP: gathers and reduce-scatters within a shard group, then the shard's gradient
    # all-reduced over the replicas (mesh [dp_replicate, dp_shard x cp]: replicas dp_shard x cp x
    # tp ranks apart); otherwise the group is every replica
    hsdp = p.zero_stage > 0 and p.dp_replicate > 1
    group = p.dp_shard * p.cp if hsdp else d
    if hsdp:
        dp_link = case.link(group, tc)
    full_ar = ring_allreduce_s(params_rank * act_bytes, group, dp_link, c)  # a gather half x 2
    reduce_ar = ring_allreduce_s(params_rank * reduce_bytes, group, dp_link, c)  # a reduce half x 2
    # Collectives issued: sharded data parallelism (FSDP, ZeRO-2/3) one per layer and pass;
    # replicated gradients the trainer's way (trainer/parallelize.py apply_replicate: FSDP2's
    # replicate per block and on the root, synced on the last micro-batch only), one per layer
    # plus the root's; ZeRO-1, which the trainer does not offer, one per 25 MB bucket (DeepSpeed's
    # and DDP's), half of them gathers. Each pays the backend's call cost as tp's do and, on CPU
    # ranks, what FSDP2's Python adds per collective (bench/gloo_groups.py: a few ms there, most of
    # what ZeRO-3 and small replicated models cost).
    if p.zero_stage >= 2:
        gather_calls = reduce_calls = layers
    elif p.zero_stage == 0:
        gather_calls, reduce_calls = 0.0, math.ceil(layers) + 1
    else:
        gather_calls = reduce_calls = math.ceil(params_rank * act_bytes / DDP_BUCKET_BYTES) / 2
    framework = "replicate" if p.zero_stage == 0 else "fsdp"  # FSDP2's replicate, or its sharding
    per_call = call_overhead_s(group, c, rpc) + call_overhead_s(group, c, rpc, framework)
    # One pass over the rank's parameters: a gather, and a reduction (zero 0: a whole all-reduce)
    gather = Comm.on(dp_link.tier, full_ar / 2 + gather_calls * per_call)
    reduce = Comm.on(dp_link.tier, reduce_ar * (1.0 if p.zero_stage == 0 else 0.5) + reduce_calls * per_call)
    if hsdp:  # each reduce pass: one all-reduce a layer (FSDP unit) over the replicas
        r = p.dp_replicate
        rep_link = case.link(r, tc * group)
        replica_ar = ring_allreduce_s(params_rank * reduce_bytes / group, r, rep_link, c)
        rep_call = call_overhead_s(r, c, rpc) + call_overhead_s(r, c, rpc, framework)
        reduce = reduce + Comm.on(rep_link.tier, replica_ar + math.ceil(layers) * rep_call)
    if expert_rank and p.edp > 1:  # the experts' gradients over their own replicas (edp, stride ep)
        e_link = case.link(p.edp, p.ep)
        e_gather = ring_allreduce_s(expert_rank * act_bytes, p.edp, e_link, c)
        e_reduce = ring_allreduce_s(expert_rank * reduce_bytes, p.edp, e_link, c)
        e_call = call_overhead_s(p.edp, c, rpc) + call_overhead_s(p.edp, c, rpc, framework)
        if p.zero_stage == 0:  # one all-reduce, a call per MoE layer
            reduce = reduce + Comm.on(e_link.tier, e_reduce + math.ceil(moe_layers) * e_call)
        else:  # a gather and a reduction; calls per layer and pass (zero 1: per bucket, halved)
            n_e = moe_layers if p.zero_stage >= 2 else math.ceil(moe_layers) / 2
            gather = gather + Comm.on(e_link.tier, e_gather / 2 + n_e * e_call)
            reduce = reduce + Comm.on(e_link.tier, e_reduce / 2 + n_e * e_call)
    dp_comm = gather * gathers + reduce * reduces
    root_share = root_params / (params_rank + expert_rank) if params_rank + expert_rank else 0.0
    dp_exposed = dp_comm  # CPU ranks: every collective blocks (overlap_rule)
    if layer is not None and case.device != "cpu":
        dp_exposed = overlap_rule(case, gather, reduce, layers, root_share, layer)

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


def overlap_rule(
    case: Case, gather: Comm, reduce: Comm, layers: float, root_share: float, layer: LayerTime
) -> Comm:
    """What of data parallelism's collectives the step waits for, from the order the trainer
    issues them in (trainer/parallelize.py, trainer/benchmark.py; torch 2.13's FSDP2 and
    pipelining), given one pass of gathers (`gather`) and one of reductions (`reduce`) over the
    rank's parameters, `root_share` of them the root module's (embedding, head: gathered first,
    reduced last):

    - GPUs: FSDP2 runs its all-gathers, reduce-scatters and all-reduces on streams of their own.
      A block's all-gather for the forward is issued while the block before it computes
      (implicit prefetch), for the backward one block ahead (explicit prefetch, the default of
      one); a block's gradient reduction right after its backward, under the next block's. So
      each pass is a chain: the first collective (the root's gather, the last block's reduction
      and the root's) waits, each later one hides behind a block's compute and shows only what it
      exceeds it by (`_chain`). The step waits for every reduction at the end of a backward
      (FSDP2's post-backward callback), so none runs under the next micro-batch.
    - Which passes run where (data_part's counts): without a pipeline ZeRO-3 gathers in every
      micro-batch's forward and backward, ZeRO-2 in every forward; sharded gradients reduce in
      every micro-batch's backward, replicated ones (zero 0) in the last one only (no_sync
      before). With a pipeline, ZeRO-2 gathers in the first forward, ZeRO-3 in the first rank's
      warm-up forwards and steady backwards, and torch's schedule reduces every gradient at its
      REDUCE_GRAD action after the stage's last backward: nothing left to hide behind, the whole
      pass waits. ZeRO-1 (priced, not run: Megatron's
      distributed optimizer without --overlap-param-gather) gathers after the optimizer step,
      exposed.
    - CPU ranks: FSDP2's streams are the calling thread's (torch's CPU device handle), every
      collective blocks: nothing hidden.
    """
    p, mb = case.layout, case.layout.num_microbatches
    fwd, bwd = layer.forward_s, layer.backward_s

    def chained(passes: Comm, compute_s: float) -> Comm:
        total = passes.total
        if total <= 0:
            return Comm()
        per_layer = (1 - root_share) * total / layers if layers else 0.0
        waited = root_share * total + _chain(per_layer, compute_s, layers)
        return passes * (min(waited, total) / total)

    exposed = Comm()
    sync_each = p.pp == 1 and p.zero_stage >= 2  # sharded gradients reduce every micro-batch
    if p.zero_stage == 3 and p.pp == 1:  # every forward gathers, every backward gathers and reduces
        exposed = exposed + chained(gather, fwd) * mb + chained(gather + reduce, bwd) * mb
    elif p.zero_stage == 3:  # the first rank's 1F1B: w + 1 forwards gather, then m - w backwards
        w = min(p.pp - 1, mb - 1)
        exposed = exposed + chained(gather, fwd) * (w + 1) + chained(gather, bwd) * (mb - w)
    elif p.zero_stage == 2 and p.pp == 1:  # every forward gathers, every backward reduces
        exposed = exposed + chained(gather, fwd) * mb + chained(reduce, bwd) * mb
    elif p.zero_stage == 2:
        exposed = exposed + chained(gather, fwd)  # the first forward's gathers, kept
    elif p.zero_stage == 1:
        exposed = exposed + gather  # after the optimizer step
    if p.pp > 1:
        exposed = exposed + reduce  # REDUCE_GRAD: after the stage's last backward
    elif not sync_each and p.zero_stage != 3:  # replicated (or ZeRO-1): the last backward's
        exposed = exposed + chained(reduce, bwd)
    return exposed


def _chain(per_layer_s: float, compute_s: float, layers: float) -> float:
    """A chain of `layers` equal collectives, each hidden behind one layer's compute but the first
    (or the last): what the compute stream waits for."""
    if per_layer_s <= 0:
        return 0.0
    return per_layer_s + max(0.0, layers - 1) * max(0.0, per_layer_s - compute_s)


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
