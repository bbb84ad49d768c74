"""What a mixture of experts adds to a step: the routed experts' GEMMs at their own efficiency,
the router, the all-to-all that dispatches tokens to their experts and combines them back, the
load imbalance between expert-parallel ranks, and the memory the experts keep (a rank's
`ExpertRank`). The step (tuner/cost/step.py) and the memory (tuner/cost/memory.py) call these;
dense models never reach them (every term here is 0 there).

Closed forms (docs/perfmodel.md, "Mixtures of experts"), per rank and micro-batch, with
T = micro_batch_size x seq_len / tp tokens routed by the rank (each tensor-parallel rank routes
its own tokens: sequence parallelism), k = moe_top_k, E = num_experts, f = expert_ffn_size:
- tokens per local expert n = ep x T x k / E (the ep group's T x k copies over its E experts);
  the experts' GEMMs reach the dense GEMMs' efficiency x n / (n + ridge) (`expert_gemm_efficiency`).
- all-to-all: 4 per MoE layer (dispatch and combine, forward and backward; 6 with full recompute,
  which runs the forward's two again), each moving T x k x h values of the compute dtype, of
  which (ep - 1)/ep leave the rank (`a2a`).
- imbalance: the experts' seconds x 1 + (I - 1) sqrt((ep - 1)/(E - 1)) (`imbalance_factor`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainer.contract.model import ModelConfig
from trainer.contract.parallel import ParallelConfig
from trainer.contract.rules import V_SCHEDULES
from tuner.cost import dtypes
from tuner.cost.collectives import Comm, Link, call_overhead_s
from tuner.cost.context import local_tokens
from tuner.cost.layer import (
    Op,
    attention_ops,
    layer_params,
    mlp_ops,
    op_checkpoint,
    recomputed_modules,
    weight_output_bytes_per_token,
)
from tuner.cost.pipeline import stage_layers
from tuner.spec import ClusterSpec

if TYPE_CHECKING:
    from tuner.cost.case import Case
    from tuner.cost.compute import Compute
    from tuner.cost.terms import StepTerms

# The ridge of the experts' GEMMs when the device's memory bandwidth is unknown: an expert's
# GEMM of n tokens reads its h x f weights (2 bytes each) to compute 2 n h f FLOPs, so it takes
# 2nhf/P + 2hf/B and reaches n / (n + P/B) of the compute-bound rate. H100 SXM: P/B =
# 989.4 TFLOP/s / 3.35 TB/s = 295 tokens (trainer/contract/devices.py's row).
DEFAULT_RIDGE_TOKENS = 295.0


def imbalance_factor(m: ModelConfig, p: ParallelConfig, imbalance: float) -> float:
    """How much longer the busiest expert-parallel rank's experts take than the average's:
    1 + (I - 1) sqrt((ep - 1)/(E - 1)). I (max/mean tokens per expert) is the study's
    training.moe_imbalance, 1 under forced-balance routing, capped by a token-drop capacity
    factor (priced_imbalance). One rank holding every expert (ep 1) sees the mean; one expert per
    rank (ep = E) the max; the square root interpolates as the maximum of ep/E-sized sums of
    per-expert loads falls (by the law of large numbers). I < 1 (a capacity factor below 1): every
    expert computes I x the mean, every rank too."""
    if not m.moe or m.num_experts < 2:
        return 1.0
    if imbalance < 1.0:
        return imbalance
    return 1.0 + (imbalance - 1.0) * math.sqrt((p.ep - 1) / (m.num_experts - 1))


def priced_imbalance(imbalance: float, capacity_factor: float | None) -> float:
    """The busiest expert's computed tokens over the mean it is sent: I, or with token drop
    (BenchmarkConfig.moe_capacity_factor) at most the capacity factor: no expert computes more
    than its capacity, and below 1 none computes the mean."""
    return imbalance if capacity_factor is None else min(imbalance, capacity_factor)


def routed_tokens(m: ModelConfig, p: ParallelConfig) -> float:
    """T: the tokens of one micro-batch a rank routes (its sequence-parallel shard with tp > 1, of
    its context-parallel share with cp > 1)."""
    return p.micro_batch_size * m.seq_len / (p.cp * p.tp)


def tokens_per_expert(m: ModelConfig, p: ParallelConfig) -> float:
    """n = ep x T x k / E: tokens each local expert computes per micro-batch (balanced)."""
    return p.ep * routed_tokens(m, p) * m.moe_top_k / m.num_experts


def ridge_tokens(cluster: ClusterSpec, precision: str) -> float:
    """P/B of the device in the compute dtype (fp32 weights are 4 bytes: 2 P/B), or the default."""
    row = cluster.device_row
    if row is None or cluster.device_kind != "gpu":
        return DEFAULT_RIDGE_TOKENS
    peak = cluster.peak_tflops_for(dtypes.peak_dtype(precision)) * 1e12
    return peak * dtypes.value_bytes(precision) / (2 * row.memory_gbps * 1e9)


def expert_gemm_efficiency(case: Case) -> float:
    """n / (n + ridge): the experts' GEMMs relative to a compute-bound GEMM of the same FLOPs."""
    assert case.cluster is not None
    n = tokens_per_expert(case.model, case.layout)
    return n / (n + ridge_tokens(case.cluster, case.precision))


def measured_imbalance(result: dict) -> float | None:
    """I measured by a trial (BenchmarkResult.moe, as stored): each MoE layer's max/mean tokens per
    expert, its median over the measured steps, averaged over the layers; None for a dense model,
    a trial without steps or one routed balanced (its I is 1 by construction, not a measurement).
    With token drop, at most its capacity factor (priced_imbalance: what the experts computed)."""
    moe = result.get("moe") or {}
    if moe.get("routing") != "learned":
        return None
    layers = [sorted(steps)[len(steps) // 2] for steps in (moe.get("imbalance") or {}).values() if steps]
    return priced_imbalance(sum(layers) / len(layers), moe.get("capacity_factor")) if layers else None


def moe_layers_on(m: ModelConfig, layers: float) -> float:
    """MoE layers among a stage's `layers`: as many as there are (the slowest stage is priced as
    if the dense first layers were elsewhere: a MoE layer costs a rank at least as much)."""
    return min(layers, m.num_moe_layers)


@dataclass(frozen=True)
class ExpertsPart:
    """A mixture of experts' all-to-alls per micro-batch on a stage (its compute is in the
    compute term: `MoEStep`, tuner/cost/compute.py)."""

    a2a_mb: Comm

    def terms(self, microbatches: int) -> dict[str, float]:
        return {
            "moe_a2a_intra_s": microbatches * self.a2a_mb.intra,
            "moe_a2a_inter_s": microbatches * self.a2a_mb.inter,
        }


def experts_part(case: Case, layers: float) -> ExpertsPart:
    """The all-to-alls of the MoE layers among `layers`: they block the stage like its compute
    (no overlap is priced)."""
    m = case.model
    return ExpertsPart(a2a(case) * moe_layers_on(m, layers) if m.moe else Comm())  # dense: no all-to-all


@dataclass(frozen=True)
class MoEStep:
    """One MoE layer's extra work on a rank for one micro-batch, beyond a dense layer's."""

    gemm_flops_delta: (
        float  # non-expert GEMM FLOPs (router, shared expert) less the dense MLP's, fwd+bwd(+recompute)
    )
    expert_s: float  # the routed experts' GEMMs, at their efficiency, imbalance included
    own_s_delta: float  # memory-bound work: the experts' activations less the dense MLP's, router, permutes
    a2a: Comm  # the layer's all-to-alls (dispatch, combine; forward, backward, recompute)
    efficiency: float  # expert_gemm_efficiency
    imbalance: float  # imbalance_factor
    tokens_per_expert: float


def moe_step(case: Case, dense_efficiency: float) -> MoEStep:
    """`dense_efficiency`: the dense GEMMs' fraction of peak at this layout
    (tuner.cost.compute.compute_efficiency); the imbalance: the study's I (1 for balanced routing)."""
    m, p, c = case.model, case.layout, case.constants
    h, k, e = m.hidden_size, m.moe_top_k, m.num_experts
    tokens = routed_tokens(m, p)
    full = p.activation_checkpoint == "full"
    passes = 4 if full else 3  # forward, backward (2x), recompute
    # op-level checkpointing recomputes the memory-bound work and the matmuls it does not keep
    own_passes = 4 if p.activation_checkpoint in ("full", "op") else 3
    shared_mlp = m.mlp_matrices * h * m.moe_shared_ffn_hidden_size
    dense_mlp = m.mlp_matrices * h * m.ffn_size
    gemm_delta = 2 * (shared_mlp + h * e - dense_mlp) * tokens * passes
    if p.activation_checkpoint == "op":
        gemm_delta += moe_op_recomputed_delta(m, p, case.value_bytes, case.device) * case.tokens_mb
    eff = expert_gemm_efficiency(case)
    factor = imbalance_factor(m, p, case.moe_imbalance)
    expert_flops = 2 * k * m.expert_params * tokens * passes
    expert_s = expert_flops / (dense_efficiency * eff * case.peak_flops) * factor
    # Memory-bound work in the compute term's units (16-bit bytes per token, x
    # elementwise_flops_per_byte): the experts' ffn-wide tensors replace the dense MLP's (2 units a
    # kept ffn-wide tensor: MLPKind.kept); the router's fp32 logits and scores; the permuted copies
    # in and out of the experts.
    # The experts' f-wide tensors: the weighted activation's inputs and output (expert_kept_tensors
    # without moe_act).
    routed = m.mlp_kind.inputs + 1
    mlp_units = 2 * routed * k * m.expert_ffn_size + 2 * m.mlp_kind.kept * (
        m.moe_shared_ffn_hidden_size - m.ffn_size
    )
    units = mlp_units + 8 * e + 4 * k * h
    if "moe_act" in recomputed_modules(p):  # the experts' activation twice more: for the down
        units += 2 * 2 * routed * k * m.expert_ffn_size  # projection's backward, its own
    own_delta = (
        tokens * units * case.units_16bit * own_passes * c.elementwise_flops_per_byte / case.memory_peak_flops
    )
    return MoEStep(gemm_delta, expert_s, own_delta, a2a(case), eff, factor, tokens_per_expert(m, p))


def a2a_volume_bytes(case: Case) -> float:
    """Bytes one all-to-all moves out of a rank: (ep - 1)/ep of T x k hidden states."""
    m, p = case.model, case.layout
    return routed_tokens(m, p) * m.moe_top_k * m.hidden_size * case.value_bytes * (p.ep - 1) / p.ep


def a2a_calls(p: ParallelConfig) -> int:
    """All-to-alls of hidden states per MoE layer and micro-batch: dispatch and combine in forward
    and backward, and the forward's two again when full recompute reruns the layer (op-level
    checkpointing too: the experts' input and output are not kept, trainer/moe.py's all-to-all is
    not a functional collective its policy keeps)."""
    return 6 if p.activation_checkpoint in ("full", "op") else 4


def probs_a2a_calls(p: ParallelConfig) -> int:
    """All-to-alls of the routing weights (trainer/moe.py MoE._expert_parallel: they travel with the
    tokens to weigh the experts' activation): the dispatch's in forward and backward, and again in
    a recompute of the forward."""
    return 3 if p.activation_checkpoint in ("full", "op") else 2


def a2a(case: Case) -> Comm:
    """One MoE layer's all-to-alls for one micro-batch, by tier: the hidden states' and the routing
    weights' (4 bytes an assignment: latency more than bytes). The ep group is ep neighbouring
    ranks (trainer/contract/topology.py: expert_groups): inside a node (or a scale-up domain of
    nodes, NVL72's 72 GPUs: ClusterSpec.domain_size) when ep fits in it. Spanning domains, the
    peers in the rank's domain take their share at the fast link and the rest cross the network,
    where every rank of the node sends at once: inter_node_gbps / gpus_per_node each."""
    m, p, c, cluster = case.model, case.layout, case.constants, case.cluster
    assert cluster is not None
    if p.ep <= 1:
        return Comm()
    assignments = routed_tokens(m, p) * m.moe_top_k
    link = case.link(p.ep, 1)
    overhead = call_overhead_s(p.ep, c, case.ranks_per_core)
    calls = (
        (a2a_calls(p), assignments * m.hidden_size * case.value_bytes),
        (probs_a2a_calls(p), assignments * 4),
    )
    if link.tier == "intra":
        rate = link.rate_gbps(c) * 1e9
        wire = sum(n * (b * (p.ep - 1) / p.ep / rate + link.latency_us * 1e-6 + overhead) for n, b in calls)
        return Comm(wire, 0.0)
    g = cluster.gpus_per_node
    on_node = Link(cluster.intra_node_gbps, cluster.intra_node_latency_us, "intra", link.core_gbps,
                   link.core_latency_us)  # fmt: skip
    network = Link(cluster.inter_node_gbps / g, cluster.inter_node_latency_us, "inter", link.core_gbps,
                   link.core_latency_us)  # fmt: skip
    d = cluster.domain_size  # the group's members on the rank's fast fabric
    intra = sum(n * (b * (d - 1) / p.ep / (on_node.rate_gbps(c) * 1e9) + on_node.latency_us * 1e-6)
                for n, b in calls)  # fmt: skip
    inter = sum(n * (b * (p.ep - d) / p.ep / (network.rate_gbps(c) * 1e9) + network.latency_us * 1e-6 + overhead)
                for n, b in calls)  # fmt: skip
    return Comm(intra, inter)


# Parameters and activations -------------------------------------------------------------------


def moe_layer_dense_params(m: ModelConfig, tp: int) -> float:
    """A MoE layer's parameters on a rank other than its routed experts: attention over tp; the
    router (h x E) and the shared expert replicated over tp (each rank runs them on its own tokens:
    trainer/parallelize.py), the norms (and q/k norms, q/k/v bias as a dense layer has them)."""
    h = m.hidden_size
    shared = m.mlp_matrices * h * m.moe_shared_ffn_hidden_size
    whole = m.attention_replicated_params  # latent attention's down-projections, whole on every rank
    params = (m.attention_matmul_params - whole) / tp + whole + shared + h * m.num_experts + 2 * m.norm_params
    params += m.attention_norm_params
    if m.qkv_bias:
        params += m.qkv_bias_params / tp
    return params


def local_expert_params(m: ModelConfig, ep: int) -> float:
    """A MoE layer's routed experts on a rank: E / ep whole experts (not split over tp)."""
    return m.num_experts // ep * m.expert_params


def moe_activation_delta_per_token(
    m: ModelConfig, p: ParallelConfig, cb: int, imbalance: float, device: str = "gpu"
) -> float:
    """Bytes a MoE layer keeps per token of a micro-batch beyond a dense layer's (full recompute:
    0, the layer input only), as trainer/moe.py's autograd graph saves them (traced per tensor:
    docs/perfmodel.md, "MoE activations"). Per routed assignment (k a token):
    - on the rank running the experts (the busiest ep rank: x the imbalance factor; EP does not
      shrink them, a rank computes T x k assignments whatever ep is): the experts' f-wide tensors
      (SwiGLU 4, GELU 2), their input rows once (the grouped GEMM's padded copy, GPU kernels of
      compute capability >= 9, filled by index_put, which keeps only the indices; the CPU's and an
      A100's loop over experts keeps the gathered rows; before issue 37 index_copy kept the
      gathered rows besides the padded copy), int64 row indices (1, with expert parallelism 3:
      the regrouping and its inverse), and the routing weight in the compute dtype. The f-wide
      tensors: SwiGLU's gate and up and the weighted activation's output (the down projection's
      input): 3, as Megatron-LM's fused weighted SwiGLU keeps (autograd's ops kept SiLU's output
      and the product besides: 4 until issue 37, with the weight applied after the experts);
      GELU's input and output; under moe_act the first GEMMs' outputs only (expert_kept_tensors);
    - back on the token's rank: three int64 indices (the token of each assignment, the inverse of
      the sort order, and the sort order, which gathers the routing weights to travel with the
      tokens); the experts' output in token order is summed, keeping nothing, since the
      activation carries the weight (trainer/moe.py WeightedActivation; before, a batched product
      weighted and summed it, keeping it and the weight);
    - the router's: fp32 scores of every expert (4 E), the chosen experts' int64 ids, their fp32
      weights and the sum that renormalises them; with moe_router_fp32 in a 16-bit step, its fp32
      copy of the input (4 h) in place of the compute-dtype input its matmul kept (which a shared
      expert keeps anyway: replicated over tp, it takes the same tokens), and its fp32 copy of the
      weight (4 E h a layer and micro-batch: per token, over the micro-batch's tokens).
    The shared expert keeps a dense MLP's tensors at its width. All over tp (sequence parallelism:
    T tokens a rank)."""
    if p.activation_checkpoint == "full":
        return 0.0
    if p.activation_checkpoint == "op":
        return moe_op_delta_per_token(m, p, cb, imbalance, device)
    experts = expert_kept_tensors(m, p)
    tensors = m.mlp_kind.kept
    k, h, f = m.moe_top_k, m.hidden_size, m.expert_ffn_size
    row_indices = 8 * (3 if p.ep > 1 else 1)
    # ... and each row's routing weight, which the weighted activation keeps (compute dtype)
    experts_side = k * ((experts * f + h + 1) * cb + row_indices) * imbalance
    token_side = k * 3 * 8
    renormalised = m.moe_norm_topk  # with either score (trainer/moe.py Router.select)
    router = 4 * m.num_experts + 8 * k + (4 * k + 4 if renormalised else 0)
    if m.moe_router_score == "sigmoid" and m.moe_aux_loss_coef > 0:
        router += 4  # the auxiliary loss's normalising sum of the scores
    if m.moe_router_fp32 and cb < 4:
        # (with layernorm recompute the norm's output is not kept either way)
        shared_keeps = m.moe_shared_ffn_hidden_size or "layernorm" in recomputed_modules(p)
        router += 4 * h - (0 if shared_keeps else cb * h)
        router += 4 * m.num_experts * h * p.tp / local_tokens(m, p)  # the weight, not split over tp
    shared = tensors * m.moe_shared_ffn_hidden_size * cb
    return (experts_side + token_side + router + shared - tensors * m.ffn_size * cb) / p.tp


def expert_kept_tensors(m: ModelConfig, p: ParallelConfig) -> int:
    """f-wide tensors a routed assignment keeps in the experts (trainer/moe.py WeightedActivation):
    the first GEMMs' outputs (SwiGLU's gate and up, GELU's input) and, unless moe_act recomputes
    it (recompute_without_output), the weighted activation's output, the down projection's input."""
    return m.mlp_kind.inputs + (0 if "moe_act" in recomputed_modules(p) else 1)


def moe_ops(m: ModelConfig, p: ParallelConfig, cb: int, imbalance: float, device: str = "gpu") -> list[Op]:
    """A MoE layer's MLP half as op-level checkpointing sees it (tuner.cost.layer.Op), in
    trainer/moe.py's order, per token of a micro-batch on this rank (a rank routes 1 / tp of them:
    the router and the shared expert are replicated over tp): the router's matmul (always
    recomputed: torchtitan's forced shape), its top-k values (fp32) and ids (int64), kept, the
    shared expert's linears, the experts' GEMMs at k x the imbalance factor assignments a token (on
    GPUs torch._grouped_mm, not in the policy's list: recomputed; on CPU a loop of matmuls over the
    rank's E / ep experts, kept in turn); the sum of their weighted outputs keeps nothing (before
    issue 37 a bmm weighted and summed them, its output kept)."""
    h, k, f, t = m.hidden_size, m.moe_top_k, m.expert_ffn_size, p.tp
    ops = [Op("recomputed", 0.0, 2 * h * m.num_experts / t), Op("saved", k * (4 + 8) / t)]
    if m.moe_shared_ffn_hidden_size:
        shared = mlp_ops(m, p, cb, m.moe_shared_ffn_hidden_size, 1)
        ops += [Op(o.kind, o.bytes / t, o.flops / t) for o in shared]
    share = k * imbalance / t  # assignments a token of the micro-batch, on the busiest rank
    widths = [f] * m.mlp_kind.inputs + [h]
    ins = [h] * m.mlp_kind.inputs + [f]
    if device == "gpu":
        ops += [Op("recomputed", 0.0, 2 * i * w * share) for w, i in zip(widths, ins, strict=True)]
    else:
        local = m.num_experts // p.ep
        per_expert = share / local
        for _ in range(local):
            ops += [
                Op("mm", w * per_expert * cb, 2 * i * w * per_expert)
                for w, i in zip(widths, ins, strict=True)
            ]
    return ops


def moe_op_recomputed_delta(m: ModelConfig, p: ParallelConfig, cb: int, device: str = "gpu") -> float:
    """The GEMM FLOPs op-level checkpointing runs again per token in a MoE layer beyond a dense
    one (the experts' at the mean load)."""
    attention = attention_ops(m, p, cb)
    moe = op_checkpoint(attention + moe_ops(m, p, cb, 1.0, device))[1]
    return moe - op_checkpoint(attention + mlp_ops(m, p, cb, m.ffn_size, p.tp))[1]


def moe_op_delta_per_token(
    m: ModelConfig, p: ParallelConfig, cb: int, imbalance: float, device: str = "gpu"
) -> float:
    """What a MoE layer keeps beyond a dense one under op-level checkpointing, per token: the same
    attention first (the matmuls' count carries on into the MLP half)."""
    attention = attention_ops(m, p, cb, device)
    moe, _ = op_checkpoint(attention + moe_ops(m, p, cb, imbalance, device))
    dense, _ = op_checkpoint(attention + mlp_ops(m, p, cb, m.ffn_size, p.tp))
    return moe - dense


# A rank's experts in memory -------------------------------------------------------------------


@dataclass(frozen=True)
class ExpertRank:
    """A mixture of experts' part of a pipeline rank's memory (tuner/cost/memory.py's RankBytes)."""

    num_moe: int  # MoE layers on the rank
    dense_params: float  # every layer's parameters but the routed experts
    experts: float  # the routed experts: E / ep per MoE layer
    layer_params: float  # one MoE layer's, its local experts included (what ZeRO-3 gathers)
    act_per_token: float  # what a MoE layer keeps beyond a dense one, per token of a micro-batch
    flow_per_token: float  # gradients flowing in a MoE layer's backward beyond a dense one's
    # what a split backward's input half keeps for its weight half beyond a dense layer, per token
    # (tuner.cost.layer.weight_output_bytes_per_token): the router's, the shared expert's and the
    # experts' outputs (k x the imbalance factor assignments a token) in place of the MLP's
    weight_outputs_per_token: float = 0.0


def expert_rank(
    m: ModelConfig, p: ParallelConfig, cb: int, stage: int, imbalance: float, device: str = "gpu"
) -> ExpertRank:
    """The experts of the rank at pipeline coordinate `stage`, with `cb` bytes a value of the
    compute dtype, at the study's `imbalance` (the same on either device's kernels: the grouped
    GEMM's padded copy replaces the gathered rows the CPU's loop keeps)."""
    num_moe = stage_moe_layers(m, p, stage)
    num_dense = stage_layers(m.num_layers, p, stage) - num_moe
    moe_params = moe_layer_dense_params(m, p.tp)
    experts = local_expert_params(m, p.ep)
    factor = imbalance_factor(m, p, imbalance)
    # SwiGLU's backward holds 2 ffn-wide gradients (tuner.cost.layer.flow_bytes): the experts' k
    # copies instead. (The gradient of the experts' outputs, k h-wide rows a token, is not added:
    # against the oracle it over-counts every GPU layout, +0.5 to +1.3 points, bench.moe_oracle_small.)
    k = m.moe_top_k
    grads = 2 * (k * m.expert_ffn_size * factor + m.moe_shared_ffn_hidden_size - m.ffn_size) * cb / p.tp
    if "moe_act" in recomputed_modules(p):  # what the activation's recompute brings back meanwhile
        grads += (m.mlp_kind.kept - m.mlp_kind.inputs) * m.moe_top_k * m.expert_ffn_size * factor * cb / p.tp
    weight_outputs = 0.0
    if p.pp_schedule in V_SCHEDULES:  # a split backward's (no other schedule keeps them between halves)
        share = k * factor / p.tp
        widths = m.mlp_kind.inputs * m.expert_ffn_size + m.hidden_size
        shared = (
            m.mlp_kind.inputs * m.moe_shared_ffn_hidden_size + m.hidden_size
            if m.moe_shared_ffn_hidden_size
            else 0
        )
        dense_mlp = weight_output_bytes_per_token(m, p, cb) - weight_output_bytes_per_token(
            m, p, cb, mlp=False
        )
        weight_outputs = (m.num_experts / p.tp + shared / p.tp + widths * share) * cb - dense_mlp
    return ExpertRank(
        num_moe=num_moe, dense_params=num_dense * layer_params(m, p.tp) + num_moe * moe_params,
        experts=num_moe * experts, layer_params=moe_params + experts, weight_outputs_per_token=weight_outputs,
        act_per_token=moe_activation_delta_per_token(m, p, cb, factor, device), flow_per_token=max(grads, 0.0) if num_moe else 0.0,
    )  # fmt: skip


def stage_moe_layers(m: ModelConfig, p: ParallelConfig, stage: int) -> int:
    """MoE layers on the rank at pipeline coordinate `stage`: its layers past the first
    moe_dense_layers (dense), with tuner.cost.pipeline.stage_layers' split."""
    base, extra = divmod(m.num_layers, p.num_stages)
    count = 0
    for i in p.stages_of(stage):
        start = i * base + min(i, extra)
        end = start + base + (1 if i < extra else 0)
        count += max(0, end - max(start, m.moe_dense_layers))
    return count


def moe_info(case: Case, cost: Compute, layers: int, terms: StepTerms) -> dict:
    """What a mixture of experts' terms were priced from (the plan's `experts:` line)."""
    m, p = case.model, case.layout
    x = cost.moe
    assert x is not None
    n = cost.moe_layers(layers)
    return {
        "ep": p.ep, "edp": p.edp, "num_experts": m.num_experts, "local_experts": m.num_experts // p.ep,
        "moe_layers_on_stage": n, "tokens_per_expert": x.tokens_per_expert,
        "expert_gemm_efficiency": x.efficiency, "imbalance_factor": x.imbalance,
        "a2a_tier": "inter" if x.a2a.inter else ("intra" if x.a2a.intra else "none"),
        "a2a_bytes_per_call": a2a_volume_bytes(case), "a2a_calls_per_layer": a2a_calls(p),
        "a2a_intra_s": terms.moe_a2a_intra_s, "a2a_inter_s": terms.moe_a2a_inter_s,
        "experts_compute_s": p.num_microbatches * n * x.expert_s,
    }  # fmt: skip
