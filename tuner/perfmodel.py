"""An analytic model of one training step: memory per device and step time, for any layout, with
every second of the step in a named term (`StepTerms`: they add up to `step_time_s`).

Callers price through tuner.pricing.Pricing (one per study: model, hardware, dtype, constants);
`estimate()` is the formula it calls. Memory is tuner/memmodel.py, communication
tuner/collectives.py, the constants tuner/perfconstants.py, fitting tuner/fitting.py.

Sources, cited where used: Narayanan et al. 2021 "Efficient Large-Scale Language Model Training on
GPU Clusters Using Megatron-LM" (SC'21, "Megatron-3D"); Korthikanti et al. 2022 "Reducing
Activation Recomputation in Large Transformer Models" ("Korthikanti"); Rajbhandari et al. 2020
"ZeRO" (SC'20); Chowdhery et al. 2022 "PaLM" appendix B; Thakur et al. 2005 (ring collectives).
What is not modelled is listed in docs/perfmodel.md.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import dataclass, field

from trainer.contract.model import ModelConfig
from trainer.contract.parallel import ParallelConfig
from tuner.collectives import (
    Comm,
    allreduce,
    call_overhead_s,
    group_link,
    ranks_per_core,
    ring_allreduce_s,
    send_s,
    tensor_1d,
    tensor_2d,
    tp_1d_collectives,
    wait_s,
)
from tuner.cp import attention_keys, keys_per_query, kv_traffic, local_tokens
from tuner.devicelevels import MEMORY_TRAFFIC
from tuner.memmodel import _layer_params, memory
from tuner.moe import (
    MoEStep,
    a2a,
    a2a_calls,
    a2a_volume_bytes,
    local_expert_params,
    moe_layer_dense_params,
    moe_layers_on,
    moe_step,
)
from tuner.perfconstants import ModelConstants, default_constants
from tuner.spec import ClusterSpec, padded_model

# The AdamW step moves 28 bytes per parameter (read w, g, m, v; write w, m, v, fp32). In the units
# elementwise_flops_per_byte prices (a layer's stored activation bytes, each read and written
# several times by the ops around it) that weighs ~8: chosen among 0/8/16/28 on the vTrain h1024
# tables (uncalibrated error 7.4 / 6.6 / 6.9 / 8.2 %).
OPTIMIZER_BYTES_PER_PARAM = 8.0
DDP_BUCKET_BYTES = 25e6  # torch DDP's bucket_cap_mb default: ZeRO-1's gradients go in 25 MB all-reduces


@dataclass(frozen=True)
class StepTerms:
    """A predicted step, second by second: the terms sum to the step time. Communication is split
    into the part inside a node (`_intra_s`) and the part across nodes (`_inter_s`), each priced
    on the link its group spans."""

    compute_s: float  # GEMMs, attention, memory-bound work and recompute, every micro-batch, slowest stage
    launch_floor_s: float  # layers that compute faster than launching them takes (layer_floor_s)
    microbatch_overhead_s: float  # the framework's per-micro-batch bookkeeping
    tp_comm_intra_s: float  # tensor-parallel collectives not hidden behind compute
    tp_comm_inter_s: float
    # ranks sharing cores: a tensor-parallel group waits behind the compute for its slowest member
    collective_wait_s: float
    pp_bubble_s: float  # ranks idle while the pipeline fills and drains
    pp_p2p_intra_s: float  # pipeline sends on the critical path
    pp_p2p_inter_s: float
    dp_comm_intra_s: float  # data-parallel collectives not hidden behind backward
    dp_comm_inter_s: float
    optimizer_s: float  # the AdamW step
    shared_cores_s: float  # ranks sharing CPU cores wait for a core beyond all of the above
    # A mixture of experts' all-to-alls (dispatch and combine, tuner/moe.py) on the critical path,
    # by the tier the ep group spans; 0 for a dense model.
    moe_a2a_intra_s: float = 0.0
    moe_a2a_inter_s: float = 0.0
    # Context parallelism's K/V gathers and their gradients' return (tuner/cp.py), by the tier the
    # cp group spans; 0 without it.
    cp_comm_intra_s: float = 0.0
    cp_comm_inter_s: float = 0.0

    @property
    def total_s(self) -> float:
        return sum(_TERM_VALUES(self))  # field order, as astuple summed them (bit for bit)

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


_TERM_VALUES = operator.attrgetter(*(f.name for f in dataclasses.fields(StepTerms)))

# How `tuner plan --explain`, the API and the dashboard name each term.
TERM_LABELS = {
    "compute_s": "compute", "launch_floor_s": "launch floor", "microbatch_overhead_s": "per-micro-batch overhead",
    "tp_comm_intra_s": "tensor-parallel comm (in node)", "tp_comm_inter_s": "tensor-parallel comm (across nodes)",
    "collective_wait_s": "wait behind compute before collectives", "pp_bubble_s": "pipeline bubble",
    "pp_p2p_intra_s": "pipeline sends (in node)", "pp_p2p_inter_s": "pipeline sends (across nodes)",
    "dp_comm_intra_s": "data-parallel comm (in node)", "dp_comm_inter_s": "data-parallel comm (across nodes)",
    "optimizer_s": "optimizer step", "shared_cores_s": "ranks sharing cores",
    "moe_a2a_intra_s": "expert all-to-all (in node)", "moe_a2a_inter_s": "expert all-to-all (across nodes)",
    "cp_comm_intra_s": "context-parallel K/V (in node)", "cp_comm_inter_s": "context-parallel K/V (across nodes)",
}  # fmt: skip


@dataclass(frozen=True)
class Estimate:
    memory_bytes: float
    weights_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    workspace_bytes: float
    step_time_s: float  # = terms.total_s
    terms: StepTerms
    tokens_per_s: float
    tflops_per_device: float
    mfu: float
    fits: bool
    vocab_size: int = 0  # the padded vocabulary priced (tuner.spec.padded_vocab for the layout's tp)
    # A mixture of experts: what its terms were priced from (moe_info); None for a dense model.
    moe: dict | None = None

    # The terms grouped as before the tier split (what the 2D comparison and older callers read).
    @property
    def compute_s(self) -> float:
        return self.terms.compute_s

    @property
    def tp_comm_s(self) -> float:
        return self.terms.tp_comm_intra_s + self.terms.tp_comm_inter_s

    @property
    def pp_bubble_s(self) -> float:
        return self.terms.pp_bubble_s

    @property
    def pp_p2p_s(self) -> float:
        return self.terms.pp_p2p_intra_s + self.terms.pp_p2p_inter_s

    @property
    def dp_comm_s(self) -> float:
        return self.terms.dp_comm_intra_s + self.terms.dp_comm_inter_s

    def to_dict(self) -> dict:
        """Every field; `moe` only for a mixture of experts (a dense estimate keeps its keys)."""
        data = dataclasses.asdict(self)
        if data["moe"] is None:
            del data["moe"]
        return data


def _gemm_fwd_flops_per_token(m: ModelConfig) -> float:
    """2 FLOPs per weight per token (PaLM appendix B: 6N over forward and backward) of a layer's
    matmuls: q and out h x h, k and v h x kv_size (GQA), SwiGLU's three h x ffn or GELU's two."""
    return 2 * m.num_layer_matmul_params


def _attention_fwd_flops_per_token(m: ModelConfig, p: ParallelConfig) -> float:
    """The attention core's 4*s*h per token forward (PaLM appendix B: 12Lhs over both passes);
    h is the width the scores and the weighted sum multiply over (ModelConfig.attention_score_width:
    2 q_size, or latent attention's heads x (qk_nope + qk_rope + v)); s the keys a query is scored
    against, the whole causal square as PaLM counts it (context parallelism: tuner.cp.attention_keys)."""
    return 2 * attention_keys(m, p) * m.attention_score_width


def _compute_efficiency(m: ModelConfig, p: ParallelConfig, c: ModelConstants) -> float:
    """Fraction of peak a layer's GEMMs reach: small micro-batches or thin shards run slower.
    size: a micro-batch's GEMM work per rank over h, b*s*h / (tp x tp_col x cp)."""
    size = local_tokens(m, p) * m.hidden_size / (p.tp * p.tp_col)
    return c.compute_efficiency * size / (size + c.compute_half_size)


# Bytes per value of q and k that rotary positions move in a step, counted from trainer/model.py's
# apply_rope on a bf16 input: forward 58 (two fp32 copies, the negated half, the concatenation,
# two products and their sum, the cast back), backward 52 (the products' gradients, the halves
# put back together, two casts and their sum). GQA's repeat of k and v to every query head moves
# 8 bytes per value of h + kv_size (a kv-wide read and an h-wide write each way, for k and v).
ROPE_BYTES_PER_VALUE = 58 + 52
GQA_REPEAT_BYTES_PER_VALUE = 8


def _elementwise_units(m: ModelConfig) -> tuple[float, float]:
    """A layer's memory-bound traffic per token in Korthikanti's units (16-bit bytes x h, table
    2: what the layer stores), (replicated over tp, sharded over tp). GPT's block: 10 (the two
    norms' inputs and outputs 8, the dropout masks after attention and the MLP 2: the tables the
    constants were chosen on trained with dropout) and 24 (q, k, v and the attention output 8,
    GELU's input and output 2 x 2 ffn/h = 16). Llama's: no dropout (8); RMSNorm moves what
    LayerNorm moves (one statistic less, in the same pass); SwiGLU's gate and up outputs, SiLU's
    output and the product (4 x 2 ffn/h). RoPE and GQA's repeat store nothing of their own (RoPE's
    other factor is the cos/sin buffer, the repeated k and v are SDPA's inputs, counted in the 8)
    but move bytes: theirs per step, in stored bytes at MEMORY_TRAFFIC moved per stored byte over
    3 passes (13.4 (h + kv_size)/h for RoPE; Llama 3.1 8B: 16.8, 1.2 for the repeat)."""
    h, kv = m.hidden_size, m.kv_size
    replicated = 8.0 if m.family == "llama" else 10.0
    moved = ROPE_BYTES_PER_VALUE * (h + kv) if m.positions == "rope" else 0.0
    if kv < h:
        moved += GQA_REPEAT_BYTES_PER_VALUE * (h + kv)
    mlp = (8 if m.mlp == "swiglu" else 4) * m.ffn_size / h
    return replicated, 8 + moved / (3 * MEMORY_TRAFFIC * h) + mlp


def _elementwise_flops(m: ModelConfig, p: ParallelConfig, precision: str, c: ModelConstants) -> float:
    """Peak-FLOP equivalent of the memory-bound work of one layer for one micro-batch: norms,
    the MLP's activation, rotary positions, dropout, residual adds and, without flash attention,
    the softmax over the s x s scores. Its traffic is of the order of the activations the layer
    stores (Korthikanti table 2, 16-bit, GPT's block: sbh (10 + 24/t + 5as/(ht)), with sequence
    parallelism sbh/t (34 + 5as/h); other blocks: _elementwise_units), moved in forward, twice in
    backward, and again by recompute. Context parallelism: a rank's tokens, scored against
    tuner.cp.keys_per_query keys each."""
    h, a, t = m.hidden_size, m.num_heads, p.tp
    scores = 0.0 if c.flash_attention else 5 * a * keys_per_query(m, p) / h
    replicated, sharded = _elementwise_units(m)
    stored = replicated + sharded
    # 2D tensor parallelism: the residual stream (the 10) is split over the column group, the
    # heads and the MLP's ffn (the 24) over the row group only, repeated on every column rank.
    per_token = (
        h / t * (stored + scores)
        if p.sequence_parallel
        else h * (replicated / p.tp_col + (sharded + scores) / t)
    )
    passes = {"none": 3.0, "selective": 3.0 + scores / (stored + scores), "full": 4.0}[
        p.activation_checkpoint
    ]
    act_bytes = 1 if precision != "fp32" else 2  # table 2 counts 16-bit values as 2 bytes
    return local_tokens(m, p) * per_token * act_bytes * passes * c.elementwise_flops_per_byte


@dataclass(frozen=True)
class _Compute:
    """One micro-batch's compute on a stage: FLOPs at the GEMMs' efficiency, plus what runs at its
    own rate (the memory-bound work; flash attention where its efficiency is known)."""

    layer_flops: float  # one layer's forward, backward and recompute FLOPs at the GEMMs' efficiency, per rank
    layer_own_s: float  # one layer's seconds at their own rate: memory-bound work, flash attention
    gemm_fwd: float  # one layer's forward GEMM FLOPs (its weight gradients cost as much)
    head_fwd: float
    efficiency: float
    peak_flops: float
    moe: MoEStep | None = None  # what a MoE layer adds to a dense one (tuner/moe.py)
    moe_layer_count: float = 0.0  # the model's MoE layers (the slowest stage holds up to that many)

    def stage(self, layers: float, head_share: float = 1.0) -> tuple[float, float]:
        """(seconds, the weight gradients' GEMM seconds within them) of a stage of `layers` layers
        and `head_share` of the LM head; a mixture of experts' MoE layers among them
        (tuner.moe.moe_layers_on) with their experts, router and shared expert."""
        head = head_share * self.head_fwd
        flops = layers * self.layer_flops + 3 * head
        seconds = flops / self.efficiency / self.peak_flops + layers * self.layer_own_s
        if self.moe is not None:
            n, x = self.moe_layers(layers), self.moe
            seconds += n * (
                x.gemm_flops_delta / self.efficiency / self.peak_flops + x.expert_s + x.own_s_delta
            )
        return seconds, (layers * self.gemm_fwd + head) / self.efficiency / self.peak_flops

    def moe_layers(self, layers: float) -> float:
        return 0.0 if self.moe is None else min(layers, self.moe_layer_count)  # tuner.moe.moe_layers_on


def _flash_attention_s(attn_fwd: float, p: ParallelConfig, c: ModelConstants, peak_flops: float) -> float:
    """One layer's attention core with flash attention, at its own efficiency. Counted as
    flash-attn's benchmark counts the rate it reports (tuner/devicelevels.py): a causal forward
    computes half the score matrix (context parallelism's explicit masks: half of
    tuner.cp.attention_keys' count, the blocks computed), the backward 2.5 forwards (it recomputes
    the scores), and recompute (full or selective) one more forward."""
    forwards = 3.5 + (0.0 if p.activation_checkpoint == "none" else 1.0)
    return attn_fwd * 0.5 * forwards / (peak_flops * c.attention_efficiency)


def _compute(
    m: ModelConfig, p: ParallelConfig, precision: str, c: ModelConstants, peak_flops: float, memory_peak_flops: float,
    hardware: ClusterSpec | None = None, imbalance: float = 1.0,
) -> _Compute:  # fmt: skip
    """Forward, backward = 2x forward (Megatron-3D sec. 5.1), plus recompute: a whole forward (full)
    or the attention core (selective, Korthikanti sec. 5). The head's V x h matmul sits on the
    last stage. With 2D tensor parallelism the GEMMs split over tp x tp_col ranks, the attention
    core over the row group's heads only: every column rank repeats it (trainer/tp2d.py).
    Memory-bound work is written in FLOPs of `memory_peak_flops`, the low-precision peak
    (elementwise_flops_per_byte is per byte at that peak: an fp32 step moves twice the bytes, not
    at the fp32 peak's rate). A mixture of experts' MoE layers add tuner.moe.moe_step's work on
    `hardware` at the study's `imbalance`."""
    tokens_mb = local_tokens(m, p)
    gemm_fwd = _gemm_fwd_flops_per_token(m) * tokens_mb / (p.tp * p.tp_col)
    attn_fwd = _attention_fwd_flops_per_token(m, p) * tokens_mb / p.tp
    own_s = _elementwise_flops(m, p, precision, c) / memory_peak_flops
    if c.flash_attention and c.attention_efficiency is not None:
        recompute = gemm_fwd if p.activation_checkpoint == "full" else 0.0
        layer_flops = 3 * gemm_fwd + recompute
        own_s += _flash_attention_s(attn_fwd, p, c, peak_flops)
    else:
        layer_fwd = gemm_fwd + attn_fwd
        recompute = {"none": 0.0, "selective": attn_fwd, "full": layer_fwd}[p.activation_checkpoint]
        layer_flops = 3 * layer_fwd + recompute
    head_fwd = 2 * m.vocab_size * m.hidden_size * tokens_mb / (p.tp * p.tp_col)
    efficiency = _compute_efficiency(m, p, c)
    if not m.moe:
        return _Compute(layer_flops, own_s, gemm_fwd, head_fwd, efficiency, peak_flops)
    moe = moe_step(m, p, hardware, precision, c, efficiency, peak_flops, memory_peak_flops, imbalance)
    return _Compute(layer_flops, own_s, gemm_fwd, head_fwd, efficiency, peak_flops, moe, m.num_moe_layers)


@dataclass(frozen=True)
class _Rank:
    """A rank's step on dedicated devices, by part."""

    compute_mb: float  # one micro-batch's compute (or the floor below)
    floor_mb: float  # what the launch floor adds to it
    tp_mb: Comm  # exposed tensor-parallel communication per micro-batch
    tp_hidden: float  # tensor-parallel traffic overlapped with compute (2D only)
    wait_mb: float  # the wait behind the compute before blocking tensor-parallel collectives
    overhead_mb: float
    bubble: float
    p2p: Comm
    dp_comm: Comm  # all of it
    dp_exposed: Comm
    optimizer_s: float
    # a mixture of experts' all-to-alls per micro-batch (tuner/moe.py)
    a2a_mb: Comm = field(default_factory=Comm)
    # context parallelism's K/V gathers and gradient returns per micro-batch (tuner/cp.py)
    cp_mb: Comm = field(default_factory=Comm)

    @property
    def stage_mb(self) -> float:
        return (
            self.compute_mb
            + self.floor_mb
            + self.tp_mb.total
            + self.wait_mb
            + self.overhead_mb
            + self.a2a_mb.total
            + self.cp_mb.total
        )

    def step_s(self, microbatches: int) -> float:
        """The step on dedicated devices: the slowest stage's micro-batches, the bubble, the
        exposed sends and data-parallel traffic, the optimizer."""
        return (
            microbatches * self.stage_mb
            + self.bubble
            + self.p2p.total
            + self.dp_exposed.total
            + self.optimizer_s
        )

    def busy_s(self, microbatches: int) -> float:
        """What keeps the rank's core busy in a step (every collective's CPU part, hidden or not)."""
        return (
            microbatches * (self.stage_mb + self.tp_hidden)
            + self.p2p.total
            + self.dp_comm.total
            + self.optimizer_s
        )


def _rank_step(
    m: ModelConfig, p: ParallelConfig, cluster: ClusterSpec, precision: str, c: ModelConstants,
    compute_mb: float, layers: float, dw_mb: float = 0.0, vocab_share: float = 1.0,
    memory_peak_flops: float = 1.0,
) -> _Rank:  # fmt: skip
    """The step's parts on `cluster`'s links (compute_mb fixed: the links change only these);
    dw_mb: the weight-gradient GEMMs' share of compute_mb (what 2D tensor parallelism overlaps);
    `layers` and `vocab_share` (of the V x h parameters) are the rank's: the slowest stage's
    (layers and all of it), or a pipeline's average rank's (L / pp layers, 1 / pp of it)."""
    h, t, pp, v, mb = m.hidden_size, p.tp, p.pp, p.virtual_stages, p.num_microbatches
    d = p.dp * p.cp  # ranks holding the same weights: context parallelism's too (tuner/cp.py)
    tc = t * p.tp_col  # ranks that share each weight (the tensor-parallel block)
    tokens_mb = local_tokens(m, p)
    act_bytes = 2 if precision != "fp32" else 4
    if p.tp_col > 1:
        tp_mb, tp_hidden = tensor_2d(m, p, cluster, act_bytes, c, layers, dw_mb)
    else:
        tp_mb, tp_hidden = tensor_1d(m, p, cluster, act_bytes, c, layers), 0.0

    floor_mb = max(0.0, layers * c.layer_floor_s - compute_mb)
    # With tensor parallelism each compute segment of a layer ends in a blocking collective of the
    # group: where ranks share cores, the group waits for its slowest member. The CPU work before
    # them is the compute and, with 1D's DTensor, the framework's Python around each call.
    rpc = ranks_per_core(cluster, p.world_size)
    wait_mb = 0.0
    if tc > 1:
        dtensor_mb = (
            layers * tp_1d_collectives(p) * call_overhead_s(t, c, rpc, "dtensor") if p.tp_col == 1 else 0.0
        )
        wait_mb = wait_s(compute_mb + floor_mb + dtensor_mb, c, rpc)
    # Pipeline: the bubble is (p-1) stage-times, divided by v when interleaved (Megatron-3D sec. 2.2).
    # The framework's per-micro-batch bookkeeping runs on each rank's CPU and does not lengthen it.
    # A mixture of experts' all-to-alls block the stage like its compute (no overlap is priced).
    moe_layers = moe_layers_on(m, layers) if m.moe else 0
    a2a_mb = a2a(m, p, cluster, precision, c) * moe_layers if m.moe else Comm()
    cp_mb = kv_traffic(m, p, cluster, precision, c) * layers  # blocks each layer's attention
    bubble = (pp - 1) / v * (compute_mb + floor_mb + tp_mb.total + wait_mb + a2a_mb.total + cp_mb.total)
    p2p = Comm()
    if pp > 1:
        # scatter/gather: sec. 4.1; 2D: the residual stream is split over the column group
        msg = tokens_mb * h * act_bytes / (t if p.sequence_parallel else p.tp_col)
        # forward activation + backward gradient per micro-batch per chunk, on the critical path
        p2p = send_s(msg, group_link(cluster, pp, tc * d), c) * (2 * (mb * v + pp - 1))
        if m.tie_embeddings:  # the two copies' fp32 gradients summed between the first and the last
            # stage once a step, this rank's shard (trainer/pipeline.py TiedEmbeddings; Megatron's
            # embedding group), blocking before clipping
            shard = tc * (p.dp_shard * p.cp if p.zero_stage else 1)
            ends = group_link(cluster, 2, (pp - 1) * tc * d)
            p2p = p2p + allreduce(m.vocab_size * h / shard * 4, 2, ends, c, rpc)

    # Data parallelism: gradients all-reduced once per step; ZeRO/FSDP splits it into
    # reduce-scatter + all-gather (same bytes, ZeRO sec. 7); ZeRO-3 gathers parameters for
    # forward and again for backward of every micro-batch (1.5x, ZeRO sec. 7.2.2).
    dp_link = group_link(cluster, d, tc)
    params_rank = layers * _layer_params(m, t, p.tp_col) + vocab_share * m.vocab_size * h / tc
    expert_rank = 0.0
    if m.moe:  # MoE layers: their routed experts (E / ep a rank) reduce over edp, the rest over dp
        dense_layers = (layers - moe_layers) * _layer_params(m, t, p.tp_col)
        moe_rest = moe_layers * moe_layer_dense_params(m, t)
        params_rank = dense_layers + moe_rest + vocab_share * m.vocab_size * h / tc
        expert_rank = moe_layers * local_expert_params(m, p.ep)
    full_ar = ring_allreduce_s(params_rank * act_bytes, d, dp_link, c)
    if p.zero_stage == 3:
        halves = 2 * mb + (mb if pp == 1 else 1)
    elif p.zero_stage == 2 and pp == 1:  # reduce-scatter every micro-batch, one all-gather
        halves = mb + 1
    else:
        halves = 2
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
    per_call = call_overhead_s(d, c, rpc) + call_overhead_s(d, c, rpc, framework)
    dp_comm = Comm.on(dp_link.tier, full_ar / 2 * halves + n_dp_collectives * per_call)
    if expert_rank and p.edp > 1:  # the experts' gradients over their own replicas (edp, stride ep)
        e_link = group_link(cluster, p.edp, p.ep)
        e_ar = ring_allreduce_s(expert_rank * act_bytes, p.edp, e_link, c)
        n_e = halves * moe_layers if p.zero_stage >= 2 else math.ceil(moe_layers)
        e_call = call_overhead_s(p.edp, c, rpc) + call_overhead_s(p.edp, c, rpc, framework)
        dp_comm = dp_comm + Comm.on(e_link.tier, e_ar / 2 * halves + n_e * e_call)
    dp_exposed = dp_comm * (1 - c.dp_overlap)

    # The optimizer step (AdamW) once per step over the rank's parameters, memory-bound like the
    # work between the GEMMs: it reads weights, gradients, m and v and writes weights, m and v.
    # ZeRO >= 1 shards it over dp; replicated, every data-parallel rank repeats it.
    opt_params = params_rank / (d if p.zero_stage >= 1 else 1)
    if expert_rank:
        opt_params += expert_rank / (p.edp if p.zero_stage >= 1 else 1)
    optimizer_s = opt_params * OPTIMIZER_BYTES_PER_PARAM * c.elementwise_flops_per_byte / memory_peak_flops

    return _Rank(compute_mb, floor_mb, tp_mb, tp_hidden, wait_mb, c.microbatch_overhead_s, bubble, p2p,
                 dp_comm, dp_exposed, optimizer_s, a2a_mb, cp_mb)  # fmt: skip


def _on_node_links(cluster: ClusterSpec) -> ClusterSpec:
    """The cluster with every link as fast as the node's own: what the communication costs the
    CPUs that drive it, without the time spent waiting on a slower wire."""
    return cluster.model_copy(update={"inter_node_gbps": cluster.intra_node_gbps,
                                      "inter_node_latency_us": cluster.intra_node_latency_us})  # fmt: skip


def _shared_cores_bound(
    m: ModelConfig, p: ParallelConfig, cluster: ClusterSpec, precision: str, c: ModelConstants, cost: _Compute,
    slowest: _Rank, layers: int,
) -> float:  # fmt: skip
    """Ranks sharing cores: a rank idle in the bubble lends its core to the others, and gloo's
    collectives are CPU work too, so the node's total busy time over its cores bounds the step.
    That total is the average rank's work x ranks: with a pipeline the slowest stage (the most
    layers, the LM head) is not what every rank does.
    Only the CPU part of a collective counts: over a link slower than the node's own, the rank
    waits on the wire and its core is free (priced as if every link were on-node). The overlapped
    part of 2D tensor parallelism's traffic keeps a core busy too. What the slower wire adds on
    top is a wait no core can fill: collectives are synchronous (every rank reaches DP's
    all-reduce, a pipeline's send or a TP exchange in the same phase of the step), so the whole
    world waits on the wire at once."""
    mb = p.num_microbatches
    memory_peak = cluster.peak_tflops * 1e12
    on_node = cluster if cluster.inter_node_gbps >= cluster.intra_node_gbps else _on_node_links(cluster)

    def rank(
        link_cluster: ClusterSpec, compute: float, dw: float, n_layers: float, vocab_share: float
    ) -> _Rank:
        return _rank_step(m, p, link_cluster, precision, c, compute, n_layers, dw, vocab_share, memory_peak)

    compute_mb, dw_mb = cost.stage(layers)
    cpu = slowest if on_node is cluster else rank(on_node, compute_mb, dw_mb, layers, 1.0)
    wire = slowest.step_s(mb) - cpu.step_s(mb)
    avg = cpu  # one stage: every rank is the slowest
    if p.pp > 1:
        layers_avg = m.num_layers / p.pp
        compute_avg, dw_avg = cost.stage(layers_avg, 1 / p.pp)
        avg = rank(on_node, compute_avg, dw_avg, layers_avg, 1 / p.pp)
    ranks = min(p.world_size, cluster.gpus_per_node)
    return avg.busy_s(mb) * ranks / cluster.cores_per_node + max(wire, 0.0)


def estimate(
    m: ModelConfig,
    p: ParallelConfig,
    cluster: ClusterSpec,
    precision: str = "bf16",
    constants: ModelConstants | None = None,
    moe_imbalance: float = 1.0,
) -> Estimate:
    """Memory and step time of layout `p` of model `m` on `cluster`, computing in `precision`
    (the dtype trials run in: tuner.pricing.Pricing passes StudySpec.trial_dtype). `moe_imbalance`:
    a mixture of experts' max/mean tokens per expert (StudySpec.moe_imbalance; 1: balanced)."""
    c = constants or default_constants(cluster)
    m = padded_model(m, p.tp)  # the vocabulary the layout builds (Megatron's padding)
    mem = memory(m, p, precision, c, cluster.device_kind, moe_imbalance)
    mb = p.num_microbatches
    layers = math.ceil(m.num_layers / (p.pp * p.virtual_stages)) * p.virtual_stages
    peak_tflops = cluster.peak_tflops_for("fp32" if precision == "fp32" else "bf16")
    cost = _compute(
        m, p, precision, c, peak_tflops * 1e12, cluster.peak_tflops * 1e12, cluster, moe_imbalance
    )
    compute_mb, dw_mb = cost.stage(layers)
    k = _rank_step(
        m, p, cluster, precision, c, compute_mb, layers, dw_mb, memory_peak_flops=cluster.peak_tflops * 1e12
    )
    dedicated = k.step_s(mb)
    shared = 0.0
    if cluster.cores_per_node:
        bound = _shared_cores_bound(m, p, cluster, precision, c, cost, k, layers)
        shared = max(0.0, bound - dedicated)
    terms = StepTerms(
        compute_s=mb * k.compute_mb, launch_floor_s=mb * k.floor_mb, microbatch_overhead_s=mb * k.overhead_mb,
        tp_comm_intra_s=mb * k.tp_mb.intra, tp_comm_inter_s=mb * k.tp_mb.inter,
        collective_wait_s=mb * k.wait_mb, pp_bubble_s=k.bubble,
        pp_p2p_intra_s=k.p2p.intra, pp_p2p_inter_s=k.p2p.inter, dp_comm_intra_s=k.dp_exposed.intra,
        dp_comm_inter_s=k.dp_exposed.inter, optimizer_s=k.optimizer_s, shared_cores_s=shared,
        moe_a2a_intra_s=mb * k.a2a_mb.intra, moe_a2a_inter_s=mb * k.a2a_mb.inter,
        cp_comm_intra_s=mb * k.cp_mb.intra, cp_comm_inter_s=mb * k.cp_mb.inter,
    )  # fmt: skip
    step = terms.total_s
    tokens_per_s = p.global_batch_size * m.seq_len / step
    tflops = m.flops_per_token * tokens_per_s / p.world_size / 1e12
    return Estimate(
        **mem,
        vocab_size=m.vocab_size,
        step_time_s=step,
        terms=terms,
        tokens_per_s=tokens_per_s,
        tflops_per_device=tflops,
        mfu=tflops / peak_tflops,
        fits=mem["memory_bytes"] <= cluster.device_memory_bytes * (1 - c.memory_margin),
        moe=moe_info(m, p, cluster, precision, cost, layers, terms) if m.moe else None,
    )


def moe_info(
    m: ModelConfig, p: ParallelConfig, cluster: ClusterSpec, precision: str, cost: _Compute, layers: int,
    terms: StepTerms,
) -> dict:  # fmt: skip
    """What a mixture of experts' terms were priced from (the plan's `experts:` line)."""
    x = cost.moe
    assert x is not None
    n = cost.moe_layers(layers)
    return {
        "ep": p.ep, "edp": p.edp, "num_experts": m.num_experts, "local_experts": m.num_experts // p.ep,
        "moe_layers_on_stage": n, "tokens_per_expert": x.tokens_per_expert,
        "expert_gemm_efficiency": x.efficiency, "imbalance_factor": x.imbalance,
        "a2a_tier": "inter" if x.a2a.inter else ("intra" if x.a2a.intra else "none"),
        "a2a_bytes_per_call": a2a_volume_bytes(m, p, precision), "a2a_calls_per_layer": a2a_calls(p),
        "a2a_intra_s": terms.moe_a2a_intra_s, "a2a_inter_s": terms.moe_a2a_inter_s,
        "experts_compute_s": p.num_microbatches * n * x.expert_s,
    }  # fmt: skip
