"""What a mixture of experts adds to a step: the routed experts' GEMMs at their own efficiency,
the router, the all-to-all that dispatches tokens to their experts and combines them back, the
load imbalance between expert-parallel ranks, and the memory the experts keep. tuner/perfmodel.py
and tuner/memmodel.py call these; dense models never reach them (every term here is 0 there).

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
from tuner.collectives import Comm, Link, call_overhead_s, group_link, ranks_per_core
from tuner.spec import ClusterSpec

if TYPE_CHECKING:
    from tuner.perfconstants import ModelConstants

# The ridge of the experts' GEMMs when the device's memory bandwidth is unknown: an expert's
# GEMM of n tokens reads its h x f weights (2 bytes each) to compute 2 n h f FLOPs, so it takes
# 2nhf/P + 2hf/B and reaches n / (n + P/B) of the compute-bound rate. H100 SXM: P/B =
# 989.4 TFLOP/s / 3.35 TB/s = 295 tokens (trainer/contract/devices.py's row).
DEFAULT_RIDGE_TOKENS = 295.0


def imbalance_factor(m: ModelConfig, p: ParallelConfig, imbalance: float) -> float:
    """How much longer the busiest expert-parallel rank's experts take than the average's:
    1 + (I - 1) sqrt((ep - 1)/(E - 1)). I (max/mean tokens per expert) is the study's
    training.moe_imbalance, 1 under forced-balance routing. One rank holding every expert (ep 1)
    sees the mean; one expert per rank (ep = E) the max; the square root interpolates as the
    maximum of ep/E-sized sums of per-expert loads falls (by the law of large numbers)."""
    if not m.moe or m.num_experts < 2:
        return 1.0
    return 1.0 + (imbalance - 1.0) * math.sqrt((p.ep - 1) / (m.num_experts - 1))


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
    peak = cluster.peak_tflops_for("fp32" if precision == "fp32" else "bf16") * 1e12
    bytes_per_value = 4 if precision == "fp32" else 2
    return peak * bytes_per_value / (2 * row.memory_gbps * 1e9)


def expert_gemm_efficiency(m: ModelConfig, p: ParallelConfig, cluster: ClusterSpec, precision: str) -> float:
    """n / (n + ridge): the experts' GEMMs relative to a compute-bound GEMM of the same FLOPs."""
    n = tokens_per_expert(m, p)
    return n / (n + ridge_tokens(cluster, precision))


def measured_imbalance(result: dict) -> float | None:
    """I measured by a trial (BenchmarkResult.moe, as stored): each MoE layer's max/mean tokens per
    expert, its median over the measured steps, averaged over the layers; None for a dense model,
    a trial without steps or one routed balanced (its I is 1 by construction, not a measurement)."""
    moe = result.get("moe") or {}
    if moe.get("routing") != "learned":
        return None
    layers = [sorted(steps)[len(steps) // 2] for steps in (moe.get("imbalance") or {}).values() if steps]
    return sum(layers) / len(layers) if layers else None


def moe_layers_on(m: ModelConfig, layers: float) -> float:
    """MoE layers among a stage's `layers`: as many as there are (the slowest stage is priced as
    if the dense first layers were elsewhere: a MoE layer costs a rank at least as much)."""
    return min(layers, m.num_moe_layers)


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


def moe_step(
    m: ModelConfig, p: ParallelConfig, cluster: ClusterSpec, precision: str, c: ModelConstants,
    dense_efficiency: float, peak_flops: float, memory_peak_flops: float, imbalance: float,
) -> MoEStep:  # fmt: skip
    """`dense_efficiency`: the dense GEMMs' fraction of peak at this layout (perfmodel's
    _compute_efficiency); `imbalance`: the study's I (1 for balanced routing)."""
    h, k, e = m.hidden_size, m.moe_top_k, m.num_experts
    tokens = routed_tokens(m, p)
    full = p.activation_checkpoint == "full"
    passes = 4 if full else 3  # forward, backward (2x), recompute
    shared_mlp = m.mlp_matrices * h * m.moe_shared_ffn_hidden_size
    dense_mlp = m.mlp_matrices * h * m.ffn_size
    gemm_delta = 2 * (shared_mlp + h * e - dense_mlp) * tokens * passes
    eff = expert_gemm_efficiency(m, p, cluster, precision)
    factor = imbalance_factor(m, p, imbalance)
    expert_flops = 2 * k * m.expert_params * tokens * passes
    expert_s = expert_flops / (dense_efficiency * eff * peak_flops) * factor
    # Memory-bound work in perfmodel's units (16-bit bytes per token, x elementwise_flops_per_byte):
    # the experts' ffn-wide tensors replace the dense MLP's; the router's fp32 logits and scores;
    # the permuted copies in and out of the experts.
    act_bytes = 1 if precision != "fp32" else 2
    mlp_units = (8 if m.mlp == "swiglu" else 4) * (
        k * m.expert_ffn_size + m.moe_shared_ffn_hidden_size - m.ffn_size
    )
    units = mlp_units + 8 * e + 4 * k * h
    own_delta = tokens * units * act_bytes * passes * c.elementwise_flops_per_byte / memory_peak_flops
    return MoEStep(gemm_delta, expert_s, own_delta, a2a(m, p, cluster, precision, c), eff, factor,
                   tokens_per_expert(m, p))  # fmt: skip


def a2a_volume_bytes(m: ModelConfig, p: ParallelConfig, precision: str) -> float:
    """Bytes one all-to-all moves out of a rank: (ep - 1)/ep of T x k hidden states."""
    act_bytes = 2 if precision != "fp32" else 4
    return routed_tokens(m, p) * m.moe_top_k * m.hidden_size * act_bytes * (p.ep - 1) / p.ep


def a2a_calls(p: ParallelConfig) -> int:
    """All-to-alls per MoE layer and micro-batch: dispatch and combine in forward and backward,
    and the forward's two again when full recompute reruns the layer."""
    return 6 if p.activation_checkpoint == "full" else 4


def a2a(m: ModelConfig, p: ParallelConfig, cluster: ClusterSpec, precision: str, c: ModelConstants) -> Comm:
    """One MoE layer's all-to-alls for one micro-batch, by tier. The ep group is ep neighbouring
    ranks (trainer/contract/topology.py: expert_groups): inside a node when ep <= gpus_per_node. Spanning
    nodes, the peers on the rank's node take their share at the node's link and the rest cross
    the network, where every rank of the node sends at once: inter_node_gbps / gpus_per_node each."""
    if p.ep <= 1:
        return Comm()
    per_rank = routed_tokens(m, p) * m.moe_top_k * m.hidden_size * (2 if precision != "fp32" else 4)
    link = group_link(cluster, p.ep, 1)
    calls = a2a_calls(p)
    overhead = call_overhead_s(p.ep, c, ranks_per_core(cluster, p.world_size))
    if link.tier == "intra":
        wire = per_rank * (p.ep - 1) / p.ep / (link.rate_gbps(c) * 1e9) + link.latency_us * 1e-6
        return Comm(calls * (wire + overhead), 0.0)
    g = cluster.gpus_per_node
    on_node = Link(cluster.intra_node_gbps, cluster.intra_node_latency_us, "intra", link.core_gbps,
                   link.core_latency_us)  # fmt: skip
    network = Link(cluster.inter_node_gbps / g, cluster.inter_node_latency_us, "inter", link.core_gbps,
                   link.core_latency_us)  # fmt: skip
    intra = per_rank * (g - 1) / p.ep / (on_node.rate_gbps(c) * 1e9) + on_node.latency_us * 1e-6
    inter = per_rank * (p.ep - g) / p.ep / (network.rate_gbps(c) * 1e9) + network.latency_us * 1e-6
    return Comm(calls * intra, calls * (inter + overhead))


# Parameters and activations -------------------------------------------------------------------


def moe_layer_dense_params(m: ModelConfig, tp: int) -> float:
    """A MoE layer's parameters on a rank other than its routed experts: attention over tp, the
    router (h x E, replicated: each rank routes its own tokens), the shared expert over tp, the
    norms (and q/k norms, q/k/v bias as a dense layer has them)."""
    h = m.hidden_size
    shared = m.mlp_matrices * h * m.moe_shared_ffn_hidden_size
    params = (m.attention_matmul_params + shared) / tp + h * m.num_experts + 2 * m.norm_params
    params += m.attention_norm_params
    if m.qkv_bias:
        params += m.qkv_bias_params / tp
    return params


def local_expert_params(m: ModelConfig, ep: int) -> float:
    """A MoE layer's routed experts on a rank: E / ep whole experts (not split over tp)."""
    return m.num_experts // ep * m.expert_params


def moe_activation_delta_per_token(
    m: ModelConfig, p: ParallelConfig, cb: int, imbalance: float, grouped: bool = True
) -> float:
    """Bytes a MoE layer keeps per token of a micro-batch beyond a dense layer's (full recompute:
    0, the layer input only), as trainer/moe.py's autograd graph saves them (traced per tensor:
    docs/perfmodel.md, "MoE activations"). Per routed assignment (k a token):
    - on the rank running the experts (the busiest ep rank: x the imbalance factor; EP does not
      shrink them, a rank computes T x k assignments whatever ep is): the experts' f-wide tensors
      (SwiGLU 4, GELU 2), their input rows (the grouped GEMM's padded copy besides the gathered
      rows that index_copy keeps: `grouped`, GPU kernels of compute capability >= 9; the CPU's and
      an A100's loop over experts keeps the gathered rows only) and int64 row indices (1, with
      expert parallelism 3: the regrouping and its inverse);
    - back on the token's rank: the experts' output before and after the router's weight (the
      multiply and the index_add that combines them keep one each), the weight in the compute
      dtype and two int64 indices (the token of each assignment, the sort order);
    - the router's: fp32 scores of every expert (4 E), the chosen experts' int64 ids, their fp32
      weights and the sum that renormalises them.
    The shared expert keeps a dense MLP's tensors at its width. All over tp (sequence parallelism:
    T tokens a rank)."""
    if p.activation_checkpoint == "full":
        return 0.0
    tensors = 4 if m.mlp == "swiglu" else 2
    k, h, f = m.moe_top_k, m.hidden_size, m.expert_ffn_size
    inputs = 2 if grouped else 1
    row_indices = 8 * (3 if p.ep > 1 else 1)
    experts_side = k * ((tensors * f + inputs * h) * cb + row_indices) * imbalance
    token_side = k * (2 * h * cb + cb + 2 * 8)
    renormalised = m.moe_router_score == "sigmoid" or m.moe_norm_topk
    router = 4 * m.num_experts + 8 * k + (4 * k + 4 if renormalised else 0)
    if m.moe_router_score == "sigmoid" and m.moe_aux_loss_coef > 0:
        router += 4  # the auxiliary loss's normalising sum of the scores
    shared = tensors * m.moe_shared_ffn_hidden_size * cb
    return (experts_side + token_side + router + shared - tensors * m.ffn_size * cb) / p.tp
