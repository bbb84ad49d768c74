"""The compute part of a step: a micro-batch's GEMMs at the layout's efficiency, the attention
core, the memory-bound work between them and recompute, per stage (`Compute.stage`); the launch
floor and the framework's per-micro-batch overhead (`ComputePart`). A mixture of experts' layers
add their experts' work (experts.moe_step).

Sources, cited where used: Narayanan et al. 2021 "Efficient Large-Scale Language Model Training on
GPU Clusters Using Megatron-LM" (SC'21, "Megatron-3D"); Korthikanti et al. 2022 "Reducing
Activation Recomputation in Large Transformer Models" ("Korthikanti"); Chowdhery et al. 2022
"PaLM" appendix B.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainer.contract.devices import Device
from trainer.contract.families import family_of
from trainer.contract.model import ModelConfig
from trainer.contract.parallel import ParallelConfig
from tuner.cost.context import attention_keys, keys_per_query
from tuner.cost.experts import MoEStep, moe_step
from tuner.cost.layer import op_recomputed_flops_per_token, recomputed_modules, up_projection_flops_per_token
from tuner.cost.memory import rank_bytes
from tuner.cost.pipeline import split_backward_s, stage_layers
from tuner.devicelevels import MEMORY_TRAFFIC

if TYPE_CHECKING:
    from tuner.cost.case import Case


@dataclass(frozen=True)
class ComputePart:
    """A stage's compute per micro-batch, the launch floor, the framework's bookkeeping."""

    compute_mb: float  # one micro-batch's compute (or the floor below)
    floor_mb: float  # what the launch floor adds to it
    overhead_mb: float  # the framework's per-micro-batch bookkeeping
    offload_mb: float = 0.0  # activation offload's copies to host memory and back (memory.offload_s)

    def terms(self, microbatches: int) -> dict[str, float]:
        return {
            "compute_s": microbatches * self.compute_mb,
            "launch_floor_s": microbatches * self.floor_mb,
            "microbatch_overhead_s": microbatches * self.overhead_mb,
            "offload_s": microbatches * self.offload_mb,
        }


def compute_part(case: Case, compute_mb: float, layers: float) -> ComputePart:
    """Layers that compute faster than launching them takes wait for the launches (layer_floor_s;
    on GPUs with a V schedule's split backwards, host work too: pipeline.split_backward_s)."""
    c = case.constants
    floor = c.layer_floor_s + (split_backward_s(case) if case.device != "cpu" else 0.0)
    offload = offload_s(case, layers) if case.layout.activation_checkpoint == "offload" else 0.0
    return ComputePart(compute_mb, max(0.0, layers * floor - compute_mb), c.microbatch_overhead_s, offload)


def offload_s(case: Case, layers: float) -> float:
    """Activation offload (trainer/offload.py): one micro-batch's saved activations of `layers`
    layers copied to host memory in the forward and back in the backward, each way at the device's
    host link (Device.host_gbps, nominal: not measured here), exposed: the trainer's copies run in
    the compute stream's order, nothing overlaps them (Megatron-LM's offload overlaps them on a
    stream of their own). On CPU ranks host memory is the device: the two copies as memory-bound
    work, each tensor's bytes counted once as the element-wise terms count them
    (bench/offload.py measures it)."""
    per_layer = rank_bytes(case, 0).offloaded / max(1, stage_layers(case.model.num_layers, case.layout, 0))
    moved = 2 * per_layer * layers
    if case.device == "cpu":
        return moved * case.constants.elementwise_flops_per_byte / case.memory_peak_flops
    assert case.cluster is not None
    row = case.cluster.device_row  # a device the table lacks: a PCIe Gen4 link (Device's default)
    return moved / ((row.host_gbps if row is not None else Device.host_gbps) * 1e9)


def gemm_fwd_flops_per_token(m: ModelConfig) -> float:
    """2 FLOPs per weight per token (PaLM appendix B: 6N over forward and backward) of a layer's
    matmuls: q and out h x h, k and v h x kv_size (GQA), SwiGLU's three h x ffn or GELU's two."""
    return 2 * m.num_layer_matmul_params


def attention_fwd_flops_per_token(m: ModelConfig, p: ParallelConfig) -> float:
    """The attention core's 4*s*h per token forward (PaLM appendix B: 12Lhs over both passes);
    h is the width the scores and the weighted sum multiply over (ModelConfig.attention_score_width:
    2 q_size, or latent attention's heads x (qk_nope + qk_rope + v)); s the keys a query is scored
    against, the whole causal square as PaLM counts it (context parallelism: context.attention_keys)."""
    return 2 * attention_keys(m, p) * m.attention_score_width


def forward_share(case: Case) -> float:
    """A layer's forward's share of its time in a step: 1 of 3 (the backward 2x, Megatron-3D
    sec. 5.1); 1 of 4 with full recompute, which runs in the backward. Selective, op-level and
    module recompute redo a small part: counted as none."""
    return 0.25 if case.layout.activation_checkpoint == "full" else 1 / 3


def compute_efficiency(case: Case) -> float:
    """Fraction of peak a layer's GEMMs reach: small micro-batches or thin shards run slower.
    size: a micro-batch's GEMM work per rank over h, b*s*h / (tp x tp_col x cp)."""
    m, p, c = case.model, case.layout, case.constants
    size = case.tokens_mb * m.hidden_size / (p.tp * p.tp_col)
    return c.compute_efficiency * size / (size + c.compute_half_size)


# Bytes per value of q and k that rotary positions move in a step, counted from trainer/model.py's
# apply_rope on a bf16 input: forward 58 (two fp32 copies, the negated half, the concatenation,
# two products and their sum, the cast back), backward 52 (the products' gradients, the halves
# put back together, two casts and their sum). GQA moves nothing of its own: SDPA's enable_gqa
# reads each KV head for its group of query heads (before issue 37 a repeat of k and v to every
# query head moved 8 bytes per value of h + kv_size).
ROPE_BYTES_PER_VALUE = 58 + 52


def elementwise_units(m: ModelConfig) -> tuple[float, float]:
    """A layer's memory-bound traffic per token in Korthikanti's units (16-bit bytes x h, table
    2: what the layer stores), (replicated over tp, sharded over tp). GPT's block: 10 (the two
    norms' inputs and outputs 8, the dropout masks after attention and the MLP 2: the tables the
    constants were chosen on trained with dropout) and 24 (q, k, v and the attention output 8,
    GELU's input and output 2 x 2 ffn/h = 16). Llama's: no dropout (8); RMSNorm moves what
    LayerNorm moves (one statistic less, in the same pass); SwiGLU's gate and up outputs, SiLU's
    output and the product (4 x 2 ffn/h). RoPE stores nothing of its own (its other factor is the
    cos/sin buffer) but moves bytes: its per step, in stored bytes at MEMORY_TRAFFIC moved per
    stored byte over 3 passes (13.4 (h + kv_size)/h; Llama 3.1 8B: 16.8)."""
    h, kv = m.hidden_size, m.kv_size
    replicated = family_of(m).replicated_units  # 8, or 10 with the dropout masks (Family)
    moved = ROPE_BYTES_PER_VALUE * (h + kv) if m.positions_kind.rotary else 0.0
    mlp = 2 * m.mlp_kind.kept * m.ffn_size / h  # 2 units a kept ffn-wide tensor (MLPKind.kept)
    return replicated, 8 + moved / (3 * MEMORY_TRAFFIC * h) + mlp


def elementwise_flops(case: Case) -> float:
    """Peak-FLOP equivalent of the memory-bound work of one layer for one micro-batch: norms,
    the MLP's activation, rotary positions, dropout, residual adds and, without flash attention,
    the softmax over the s x s scores. Its traffic is of the order of the activations the layer
    stores (Korthikanti table 2, 16-bit, GPT's block: sbh (10 + 24/t + 5as/(ht)), with sequence
    parallelism sbh/t (34 + 5as/h); other blocks: elementwise_units), moved in forward, twice in
    backward, and again by recompute. Context parallelism: a rank's tokens, scored against
    context.keys_per_query keys each."""
    m, p, c = case.model, case.layout, case.constants
    h, a, t = m.hidden_size, m.num_heads, p.tp
    scores = 0.0 if c.flash_attention else 5 * a * keys_per_query(m, p) / h
    replicated, sharded = elementwise_units(m)
    stored = replicated + sharded
    # 2D tensor parallelism: the residual stream (the 10) is split over the column group, the
    # heads and the MLP's ffn (the 24) over the row group only, repeated on every column rank.
    per_token = (
        h / t * (stored + scores)
        if p.sequence_parallel
        else h * (replicated / p.tp_col + (sharded + scores) / t)
    )
    # op-level checkpointing recomputes all of it (it keeps matmuls' and attention's outputs)
    passes = {
        "none": 3.0,
        "selective": 3.0 + scores / (stored + scores),
        "op": 4.0,
        "full": 4.0,
    }.get(p.activation_checkpoint, 3.0)  # Megatron's recompute modules: the norms below
    work = per_token * passes
    if "layernorm" in recomputed_modules(p):  # each norm twice more (its consumers' backward, its
        work += 2 * 2 * 2 * h / (t if p.sequence_parallel else 1)  # own): 2 units in, 2 out
    # table 2 counts 16-bit values as 2 bytes: an fp32 value is 2 of its units
    return case.tokens_mb * work * case.units_16bit * c.elementwise_flops_per_byte


@dataclass(frozen=True)
class Compute:
    """One micro-batch's compute on a stage: FLOPs at the GEMMs' efficiency, plus what runs at its
    own rate (the memory-bound work; flash attention where its efficiency is known)."""

    layer_flops: float  # one layer's forward, backward and recompute FLOPs at the GEMMs' efficiency, per rank
    layer_own_s: float  # one layer's seconds at their own rate: memory-bound work, flash attention
    gemm_fwd: float  # one layer's forward GEMM FLOPs (its weight gradients cost as much)
    head_fwd: float
    efficiency: float
    peak_flops: float
    moe: MoEStep | None = None  # what a MoE layer adds to a dense one (tuner/cost/experts.py)
    moe_layer_count: float = 0.0  # the model's MoE layers (the slowest stage holds up to that many)
    # CPU ranks: a V schedule's split backwards, per layer (pipeline.split_backward_s), on the core
    split_s: float = 0.0

    def stage(self, layers: float, head_share: float = 1.0) -> tuple[float, float]:
        """(seconds, the weight gradients' GEMM seconds within them) of a stage of `layers` layers
        and `head_share` of the LM head; a mixture of experts' MoE layers among them
        (experts.moe_layers_on) with their experts, router and shared expert."""
        head = head_share * self.head_fwd
        flops = layers * self.layer_flops + 3 * head
        seconds = flops / self.efficiency / self.peak_flops + layers * (self.layer_own_s + self.split_s)
        if self.moe is not None:
            n, x = self.moe_layers(layers), self.moe
            seconds += n * (
                x.gemm_flops_delta / self.efficiency / self.peak_flops + x.expert_s + x.own_s_delta
            )
        return seconds, (layers * self.gemm_fwd + head) / self.efficiency / self.peak_flops

    def moe_layers(self, layers: float) -> float:
        return 0.0 if self.moe is None else min(layers, self.moe_layer_count)  # experts.moe_layers_on


def flash_attention_s(case: Case, attn_fwd: float) -> float:
    """One layer's attention core with flash attention, at its own efficiency. Counted as
    flash-attn's benchmark counts the rate it reports (tuner/devicelevels.py): a causal forward
    computes half the score matrix (context parallelism's explicit masks: half of
    context.attention_keys' count, the blocks computed), the backward 2.5 forwards (it recomputes
    the scores), and recompute (full or selective: op-level checkpointing keeps its output) one
    more forward."""
    c = case.constants
    assert c.attention_efficiency is not None
    forwards = 3.5 + (1.0 if case.layout.activation_checkpoint in ("selective", "full") else 0.0)
    return attn_fwd * 0.5 * forwards / (case.peak_flops * c.attention_efficiency)


def compute(case: Case) -> Compute:
    """Forward, backward = 2x forward (Megatron-3D sec. 5.1), plus recompute: a whole forward (full),
    the attention core (selective, Korthikanti sec. 5) or the matmuls op-level checkpointing does
    not keep (op). The head's V x h matmul sits on the
    last stage. With 2D tensor parallelism the GEMMs split over tp x tp_col ranks, the attention
    core over the row group's heads only: every column rank repeats it (trainer/tp2d.py).
    Memory-bound work is written in FLOPs of the case's `memory_peak_flops`, the low-precision peak
    (elementwise_flops_per_byte is per byte at that peak: an fp32 step moves twice the bytes, not
    at the fp32 peak's rate). A mixture of experts' MoE layers add experts.moe_step's work on
    the case's hardware at the study's imbalance."""
    m, p, c = case.model, case.layout, case.constants
    tokens_mb = case.tokens_mb
    gemm_fwd = gemm_fwd_flops_per_token(m) * tokens_mb / (p.tp * p.tp_col)
    if m.attention_replicated_params:  # latent attention's down-projections: whole on every rank
        gemm_fwd += 2 * m.attention_replicated_params * tokens_mb * (1 - 1 / (p.tp * p.tp_col))
    attn_fwd = attention_fwd_flops_per_token(m, p) * tokens_mb / p.tp
    own_s = elementwise_flops(case) / case.memory_peak_flops
    # op-level checkpointing: the matmuls its policy does not keep (tuner.cost.layer.op_checkpoint)
    op_gemms = op_recomputed_flops_per_token(m, p, case.value_bytes) * tokens_mb
    # Megatron's mla_up_proj: latent attention's up-projections run again in the backward
    up = up_projection_flops_per_token(m, p.tp) * tokens_mb if "mla_up_proj" in recomputed_modules(p) else 0.0
    if c.flash_attention and c.attention_efficiency is not None:
        recompute = {"op": op_gemms, "full": gemm_fwd}.get(p.activation_checkpoint, up)
        layer_flops = 3 * gemm_fwd + recompute
        own_s += flash_attention_s(case, attn_fwd)
    else:
        layer_fwd = gemm_fwd + attn_fwd
        # op on CPU ranks: the CPU's SDPA kernel is not among the ops the policy keeps
        op_gemms += attn_fwd if case.device == "cpu" else 0.0
        recompute = {"selective": attn_fwd, "op": op_gemms, "full": layer_fwd}.get(
            p.activation_checkpoint, up
        )
        layer_flops = 3 * layer_fwd + recompute
    head_fwd = 2 * m.vocab_size * m.hidden_size * tokens_mb / (p.tp * p.tp_col)
    efficiency = compute_efficiency(case)
    split = split_backward_s(case) if case.device == "cpu" else 0.0  # GPUs: with the launch floor
    if not m.moe:  # the experts' work replaces the dense MLP's in their layers (tuner/cost/experts.py)
        return Compute(layer_flops, own_s, gemm_fwd, head_fwd, efficiency, case.peak_flops, split_s=split)
    moe = moe_step(case, efficiency)
    return Compute(
        layer_flops, own_s, gemm_fwd, head_fwd, efficiency, case.peak_flops, moe, m.num_moe_layers, split
    )
