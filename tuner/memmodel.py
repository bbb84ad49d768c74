"""The analytic memory model: bytes on a layout's fullest device as the trainer (trainer/) holds
them, at the peak of the phase of a step that holds the most. `tuner.perfmodel.estimate` uses it;
`fits` compares it with the device's memory.

The terms are the trainer's tensors, checked against its build on fake tensors (the memory
oracle: trainer/memcheck.py, bench/memory_oracle.py; docs/perfmodel.md says where they differ
from Megatron-LM's): ZeRO's model states (Rajbhandari et al. 2020) as FSDP2 keeps them, the
activations one layer stores (Korthikanti et al. 2022, table 2, for this trainer's modules), the
micro-batches in flight of each pipeline schedule (Narayanan et al. 2021 sec. 2.2; Korthikanti
sec. 4.2.3), and what torch's pipelining and FSDP2 keep besides. What no tensor shows (allocator
fragmentation and reserve, communication buffers, the CUDA context) is the calibrated part:
workspace_bytes and memory_scale.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainer.contract.model import ModelConfig
from trainer.contract.parallel import ParallelConfig
from tuner.cp import gathered_kv_bytes, keys_per_query, local_tokens, mask_bytes
from tuner.moe import (
    imbalance_factor,
    local_expert_params,
    moe_activation_delta_per_token,
    moe_layer_dense_params,
)

if TYPE_CHECKING:
    from trainer.contract.devices import DeviceKind
    from tuner.perfconstants import ModelConstants

PARTS = ("weights", "grads", "optimizer", "activations")


def activation_bytes_per_token(
    m: ModelConfig, p: ParallelConfig, cb: int, c: ModelConstants, residual: int | None = None,
    device: DeviceKind = "gpu",
) -> float:  # fmt: skip
    """Bytes one layer stores per token of one micro-batch, as the trainer's block saves them;
    cb: the compute dtype's bytes, residual: the residual stream's (fp32 under autocast); device:
    where the kernels run (RMSNorm keeps other tensors on CPU than on CUDA, below).

    Without recompute (Korthikanti table 2 has 10 + 24/t 16-bit bytes x h): the layer input, the
    residual after attention and both norm outputs, replicated (8h in 16 bit); with sequence
    parallelism the first two are sharded (4h/t) but the norm outputs are kept all-gathered (4h):
    torch's SequenceParallel all-gathers before the linears, which save the gathered input, where
    Megatron-LM saves its shard and gathers again in backward. Sharded over tp: q, k, v, the
    attention output (one tensor for SDPA and the out-projection), the MLP's 4h GeLU input and
    output: 24h/t. No dropout masks (dropout 0), no s x s scores (SDPA; `flash_attention` False
    adds Korthikanti's 5as/h), SDPA's fp32 log-sum-exp per head, the norms' fp32 mean and rstd.
    Selective recompute (the attention core checkpointed) drops the log-sum-exp only: SDPA keeps
    nothing else an attention core would recompute. Full recompute keeps the layer input. Under
    the trainer's autocast (bf16 without data parallelism) q, k and v each save their own cast of
    the first norm's output: 4 norm outputs instead of 2.

    2D tensor parallelism (tp_col > 1, trainer/tp2d.py): the residual stream is split over the
    column group (h/tp_col), q, k, v, the attention output and the MLP's ffn over the row group
    only (the same 24h/t on every column rank). Its layer norm is written out in torch ops, which
    keep the fp32 input (the layer input itself when it is fp32), the centred input in fp32, the
    normalised output and the norm's output (the next linear's input), and per token its mean
    and rstd and the stacked sums.

    The Llama block (docs/perfmodel.md, "Activations of the Llama block"): RMSNorm keeps what
    LayerNorm keeps on CUDA (its input and the fp32 rstd: `_fused_rms_norm`), on CPU torch's
    composite an fp32 copy of its input and the fp32 normalised input (8h a norm). Rotary
    positions keep nothing (their products' other factor is the cos/sin buffer); GQA's k and v are
    repeated to every query head before SDPA, which keeps the repeated ones, so q, k, v and the
    output are 4h/t as with multi-head attention. The SwiGLU MLP keeps the gate's output (SiLU's
    input), SiLU's output, the up projection's output and their product (the down projection's
    input): 4 ffn/t where GELU keeps 2. Under autocast the gate and up projections each cast the
    second norm's output, as q, k and v cast the first's."""
    h, a, t = m.hidden_size, m.num_heads, p.tp
    res = residual or cb
    if p.tp_col > 1:
        return _activation_bytes_per_token_2d(m, p, cb, c, res)
    shard = t if p.sequence_parallel else 1
    if p.activation_checkpoint == "full":
        return res * h / shard
    # Under autocast (an fp32 residual: no FSDP2 mixed precision) each linear casts its input
    # itself, so q, k and v save a copy each of the first norm's output where FSDP2's bf16
    # modules share one (and SwiGLU's gate and up projections of the second's).
    norms = (3 + _mlp_inputs(m) if res > cb else 2) * cb * h
    # the layer input and the residual after attention (what the norms keep of them); the norm outputs
    stream = 2 * _norm_input_bytes(m, res, device) * h / shard + norms
    # q, k, v, attention output; the MLP's
    sharded = (_attention_tensors(m) + _mlp_tensors(m) * m.ffn_size) * cb / t
    lse = 0.0 if p.activation_checkpoint == "selective" else 4 * a / t
    stats = 2 * _norm_stats_bytes(m) / shard  # two norms' statistics per token, fp32
    sharded += _qk_norm_bytes(m, cb, res, device) / t
    scores = (
        0.0 if c.flash_attention else 5 * a * keys_per_query(m, p) / t * cb / 2
    )  # Korthikanti's 5as/h x h, 16 bit
    return stream + sharded + lse + stats + scores


def _attention_tensors(m: ModelConfig) -> int:
    """Width per token of what attention keeps over tp: q, k and v (k and v repeated to every
    query head) and the output, 4 x q_size (4h unless attention_head_dim widens it). Latent
    attention (DeepSeek-V2/V3): q and k of heads x (qk_nope + qk_rope), v and the output of
    heads x v_head_dim, and the latents each up-projection reads (q's and kv's, normalised)
    with the shared rotary key; the latents are kept whole on every tensor-parallel rank, here
    counted with the rest (over tp): a small under-count with tp > 1."""
    if m.attention == "mla":
        qk = m.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim)
        latents = 2 * (m.q_lora_rank + m.kv_lora_rank) + m.qk_rope_head_dim
        return 2 * qk + 2 * m.q_size + latents
    return 4 * m.q_size


def _mlp_inputs(m: ModelConfig) -> int:
    """Linear layers that read the second norm's output: SwiGLU's gate and up, GELU's fc."""
    return 2 if m.mlp == "swiglu" else 1


def _mlp_tensors(m: ModelConfig) -> int:
    """ffn-wide tensors the MLP keeps for backward: GELU's input and output; SwiGLU's gate output
    (SiLU's input), SiLU's output, the up projection's output and their product."""
    return 4 if m.mlp == "swiglu" else 2


def _flow_bytes(m: ModelConfig, p: ParallelConfig, cb: int, res: int, tokens: int) -> float:
    """Gradients flowing in a layer's backward beyond what it keeps, for `tokens`: two of the
    residual stream's, and the MLP's: GELU's output's gradient (4h/t; its input's, which GELU's
    backward writes, takes the place of the down projection's input, freed by then); SwiGLU's
    product's gradient and the two it gives (SiLU's output's, up's), less the product freed:
    2 ffn/t in the compute dtype (found with the oracle at SwiGLU's backward: the four kept,
    less one, plus three)."""
    h, t, k = m.hidden_size, p.tp, p.tp_col
    if m.mlp == "swiglu":
        return tokens * (2 * h / k * res + 2 * m.ffn_size / t * cb)
    return tokens * (2 * h / k + 4 * h / t) * res


def _qk_norm_bytes(m: ModelConfig, cb: int, res: int, device: DeviceKind) -> int:
    """What RMSNorm on q and k keeps per token (Qwen3's per head, OLMoE's over the projection),
    before tp: its input, q and k of their KV heads (the norm precedes GQA's repeat), and the fp32
    rstd of each normalised row. On CUDA `_fused_rms_norm` keeps the input itself; on CPU, and
    under autocast (fp32 norm weights beside bf16 q and k, where CUDA runs the composite too),
    the composite keeps an fp32 copy of the input and the fp32 normalised input."""
    if m.qk_norm == "none":
        return 0
    per_value = 8 if device == "cpu" or res > cb else cb
    rows = m.num_heads + m.num_kv_heads if m.qk_norm == "head" else 2
    return per_value * (m.q_size + m.kv_size) + 4 * rows


def _norm_input_bytes(m: ModelConfig, res: int, device: DeviceKind) -> int:
    """Bytes per value a norm keeps of its input: the input itself (LayerNorm; RMSNorm on CUDA,
    `_fused_rms_norm`), or on CPU RMSNorm's composite: an fp32 copy of it (the fp32 input itself)
    and the fp32 normalised input."""
    return 4 + 4 if m.norm == "rmsnorm" and device == "cpu" else res


def _norm_stats_bytes(m: ModelConfig) -> int:
    """A norm's fp32 statistics per token: LayerNorm's mean and rstd, RMSNorm's rstd."""
    return 8 if m.norm == "layernorm" else 4


def _norm_2d_bytes(m: ModelConfig, res: int) -> int:
    """Bytes per column-split value a 2D norm keeps (trainer/tp2d.py writes it in torch ops): its
    fp32 input (a copy unless the input is fp32, then the layer input or the residual after
    attention), LayerNorm's centred fp32 input, the normalised output and the norm's output in the
    input's dtype."""
    return 4 + (4 if m.norm == "layernorm" else 0) + 2 * res


def _activation_bytes_per_token_2d(
    m: ModelConfig, p: ParallelConfig, cb: int, c: ModelConstants, res: int
) -> float:
    h, a, t, k = m.hidden_size, m.num_heads, p.tp, p.tp_col
    if p.activation_checkpoint == "full":
        return res * h / k
    norms = 2 * _norm_2d_bytes(m, res) * h / k
    sharded = (_attention_tensors(m) + _mlp_tensors(m) * m.ffn_size) * cb / t
    lse = 0.0 if p.activation_checkpoint == "selective" else 4 * a / t
    # per norm, fp32: LayerNorm's mean, rstd and two all-reduced sums; RMSNorm's rstd and sum of squares
    stats = 2 * 4 * (4 if m.norm == "layernorm" else 2)
    scores = 0.0 if c.flash_attention else 5 * a * keys_per_query(m, p) / t * cb / 2
    return norms + sharded + lse + stats + scores


def _layer_params(m: ModelConfig, tp: int, tp_col: int = 1) -> float:
    """One layer's parameters on a rank: its matmul weights over tp x tp_col, the two norms'
    weight (and LayerNorm's bias; replicated over tp, split over tp_col), q/k/v's bias (Qwen2;
    column-parallel, over tp)."""
    params = m.num_layer_matmul_params / (tp * tp_col) + 2 * m.norm_params / tp_col
    if m.qkv_bias:
        params += (m.hidden_size + 2 * m.kv_size) / tp
    return params


def model_state_bytes(
    num_params: float, precision: str, zero_stage: int, dp: int
) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes per device as ZeRO counts them (sec. 3.1:
    2 + 2 + 12 bytes per parameter in mixed precision, 4 + 4 + 8 in fp32; sec. 5: stage 1 divides
    the optimizer state by dp, stage 2 also the gradients, stage 3 also the weights). The trainer
    keeps its own split (fp32 master weights and gradients, bf16 copies while computing; `memory`
    counts that one): the same 16 bytes between steps."""
    w, g, o = (2, 2, 12) if precision != "fp32" else (4, 4, 8)
    return (
        num_params * w / (dp if zero_stage >= 3 else 1),
        num_params * g / (dp if zero_stage >= 2 else 1),
        num_params * o / (dp if zero_stage >= 1 else 1),
    )


def memory(
    m: ModelConfig,
    p: ParallelConfig,
    precision: str,
    c: ModelConstants,
    device: DeviceKind = "gpu",
    moe_imbalance: float = 1.0,
) -> dict[str, float]:
    """Bytes on the fullest device: the first or the last pipeline rank in its fullest phase,
    times memory_scale, plus workspace_bytes; split into weights (fp32 master and compute-dtype
    working copies), gradients, optimizer state (with AdamW's temporary) and activations (with
    pipeline buffers, logits, the batch and the rotary buffer). `device`: the ranks' kind
    (ClusterSpec.device_kind), whose kernels keep what they keep. A mixture of experts: its
    routed experts' state over ep and (sharded) the expert data parallelism, its routed
    activations on the busiest rank at `moe_imbalance` (tuner/moe.py)."""
    phases = [
        parts
        for stage in sorted({0, p.pp - 1})
        for parts in phase_bytes(m, p, precision, c, stage, device, moe_imbalance).values()
    ]
    worst = max(phases, key=lambda parts: sum(parts.values()))
    return {
        "memory_bytes": sum(worst.values()) * c.memory_scale + c.workspace_bytes,
        **{f"{k}_bytes": v for k, v in worst.items()},
        "workspace_bytes": c.workspace_bytes,
    }


@dataclass(frozen=True)
class _Rank:
    """What one pipeline rank holds, in bytes (see phase_bytes)."""

    params: float  # its parameters, after tp, before dp sharding
    d: int  # how many ways FSDP2 shards them (1: replicated)
    cb: int  # bytes per value of the compute dtype
    whole: float  # compute-dtype copies of every parameter
    root: float  # ... of the root unit (embedding, head), never resharded between passes
    unit: float  # ... of one layer
    layer: float  # one micro-batch's activations in one layer
    layers: float  # ... in all its layers (and the stage's kept output)
    vocab_grad: float  # the vocab-parallel embedding's gradient beyond its shard (DTensor: whole)
    head: float  # one micro-batch's on the last stage: the head's input, the fp32 log-softmax
    flow: float  # gradients flowing back inside a layer, with recompute its activations
    loss: float  # the loss's transient: logits in bf16 and fp32, or their gradients
    buffers: float  # pipeline receive buffers and the batch, all step long
    boundary: float  # what a stage sends the next per micro-batch (and gets back as its gradient)
    experts: float = 0.0  # a mixture of experts' routed experts on the rank (E / ep a MoE layer)
    ed: int = 1  # how many ways FSDP2 shards them (the expert data parallelism; 1: replicated)
    chunks: tuple[float, ...] = (1.0,)  # each local stage's share of the rank's layers (interleaved)


def phase_bytes(
    m: ModelConfig,
    p: ParallelConfig,
    precision: str,
    c: ModelConstants,
    stage: int,
    device: DeviceKind = "gpu",
    moe_imbalance: float = 1.0,
) -> dict[str, dict[str, float]]:
    """Tensor bytes of the rank at pipeline coordinate `stage` at the peak of each phase of a step
    (trainer/memcheck.py's PHASES: forward and backward; the optimizer step) as
    {phase: {PARTS: bytes}}."""
    r = _rank(m, p, precision, c, stage, device, moe_imbalance)
    master, adam, grads = 4 * r.params / r.d, 8 * r.params / r.d, 4 * r.params / r.d
    if r.experts:  # experts: fp32 master, AdamW's m and v, fp32 gradients over their own shards
        master, adam, grads = (
            master + 4 * r.experts / r.ed,
            adam + 8 * r.experts / r.ed,
            grads + 4 * r.experts / r.ed,
        )
    weights, grads_fb, acts = _forward_backward(p, r, stage, grads)
    fb = {"weights": master + weights, "grads": grads_fb, "optimizer": adam,
          "activations": acts + r.buffers}  # fmt: skip
    # foreach AdamW: one fp32 temporary of every parameter (sqrt of v)
    step = {
        "weights": master,
        "grads": grads,
        "optimizer": adam + 4 * r.params / r.d + (4 * r.experts / r.ed if r.experts else 0.0),
        "activations": r.buffers,
    }
    return {"forward_backward": fb, "optimizer": step}


def _rank(
    m: ModelConfig,
    p: ParallelConfig,
    precision: str,
    c: ModelConstants,
    stage: int,
    device: DeviceKind,
    moe_imbalance: float = 1.0,
) -> _Rank:
    low = precision != "fp32"
    cb = 2 if low else 4  # compute dtype: activations, FSDP2's gathered parameters
    dp = p.dp * p.cp  # ranks holding the same weights (FSDP2 and replicate span context parallelism's)
    residual = 4 if low and dp == 1 else cb  # autocast (no FSDP2) leaves the residual adds in fp32
    s, h, v, n, t = m.seq_len, m.hidden_size, m.vocab_size, p.num_microbatches, p.tp
    s_local = s // p.cp  # a rank's tokens of each sequence (tuner/cp.py)
    first, last = stage == 0, stage == p.pp - 1
    k = p.tp_col  # 2D: every weight over tp x tp_col, the residual stream over tp_col
    # The token embedding (and learned positions) on the first stage, the final norm and the head
    # on the last. A tied head is the embedding's weight: one with the two on one stage, a copy
    # on each with a pipeline (trainer/pipeline.py splits a deep copy).
    embed = (v * h / t + (s * h if m.positions == "learned" else 0)) / k if first else 0.0
    head_weight = 0.0 if m.tie_embeddings and first else v * h / t
    head = (head_weight + m.norm_params) / k if last else 0.0
    params = _stage_layers(m.num_layers, p, stage) * _layer_params(m, t, k) + embed + head
    moe = _moe_rank(m, p, cb, stage, moe_imbalance, device) if m.moe else None
    if moe is not None:
        params = moe.dense_params + embed + head
    tokens, shard = local_tokens(m, p), t if p.sequence_parallel else k
    boundary = tokens * h / shard * residual  # what one stage sends the next per micro-batch
    chunks = range(stage, p.num_stages, p.pp)
    receiving = sum(i > 0 for i in chunks)  # chunks with a previous stage (receive activations)
    sending = sum(i < p.num_stages - 1 for i in chunks)  # ... with a next (receive gradients)
    layer = activation_bytes_per_token(m, p, cb, c, residual, device) * tokens + gathered_kv_bytes(m, p, cb)
    if m.positions == "rope" and dp > 1 and low:
        # FSDP2's and replicate's mixed precision casts every block's floating inputs, the cos/sin
        # buffer too: each layer keeps its bf16 copy (rotary's multiplications save it).
        layer += 2 * s_local * m.head_dim * cb
    # A received input is its receive buffer; a stage's output is kept for its backward (held by
    # its send when interleaved: _interleaved_moments).
    own = sending * boundary if p.virtual_stages == 1 else 0.0
    layers = layer * _stage_layers(m.num_layers, p, stage) + (own - receiving * boundary) / p.virtual_stages
    if moe is not None:
        layers += moe.num_moe * moe.act_per_token * tokens
    logits = tokens * v / t  # per micro-batch, vocab-sharded
    recompute = 0.0
    if p.activation_checkpoint == "full":  # recomputing a layer brings its activations back
        plain = ParallelConfig(**{**p.to_dict(), "activation_checkpoint": "none"})
        recompute = activation_bytes_per_token(m, plain, cb, c, residual, device) * tokens
        recompute += gathered_kv_bytes(m, plain, cb)
        if moe is not None and moe.num_moe:
            recompute += _moe_rank(m, plain, cb, stage, moe_imbalance, device).act_per_token * tokens
    # Transient: the fp32 copy of the bf16 logits (forward), or the log-softmax's gradient and the
    # logits' (backward; loss_parallel computes the second in place).
    loss = max(4 + (cb if cb < 4 else 0), 8 if t == 1 else 4) * logits
    # The final norm keeps its input and output (the head's input); RMSNorm's CPU composite more.
    final_norm = tokens * h * (1 / shard + 1) * residual
    final_norm += tokens * h * (_norm_input_bytes(m, residual, device) - residual) / shard
    # Rotary positions: every stage module holds the cos/sin buffer, (2, s, head_dim) in fp32.
    rope = 2 * s_local * m.head_dim * 4 * p.virtual_stages if m.positions == "rope" else 0
    unit = cb * _layer_params(m, t, k)
    flow = _flow_bytes(m, p, cb, residual, tokens) + recompute
    if moe is not None:
        params_all = params + moe.experts
        unit = max(unit, cb * moe.layer_params) if moe.num_moe else unit
        flow += moe.flow_per_token * tokens
        layer = max(layer, layer + moe.act_per_token * tokens) if moe.num_moe else layer
    else:
        params_all = params
    return _Rank(
        params=params, d=p.dp_shard * p.cp if p.zero_stage else 1, cb=cb,
        # FSDP2's copies, or autocast's weight cache (which 2D's local views of the weights bypass)
        whole=cb * params_all if dp > 1 or (low and k == 1) else 0.0,
        root=cb * (embed + head), unit=unit, layer=layer, layers=layers,
        # 2D: the embedding looks up its local block, its gradient is local too
        vocab_grad=4 * v * h * (1 - 1 / t) if first and k == 1 else 0.0,
        # ... and with a pipeline the stage's output, its logits, in the stage's forward cache
        head=(final_norm if k == 1 else tokens * (8 + _norm_2d_bytes(m, residual)) * h / k)
        + (4 + (cb if p.pp > 1 else 0)) * logits if last else 0.0,
        flow=flow, loss=loss,
        buffers=n * boundary * (receiving + sending) + 2 * 8 * n * tokens + rope + mask_bytes(m, p, cb),
        boundary=boundary,
        experts=moe.experts if moe is not None else 0.0, ed=p.edp if moe is not None and p.zero_stage else 1,
        chunks=_chunk_shares(m.num_layers, p, stage),
    )  # fmt: skip


@dataclass(frozen=True)
class _MoERank:
    """A mixture of experts' part of a pipeline rank (tuner/moe.py has the closed forms)."""

    num_moe: int  # MoE layers on the rank
    dense_params: float  # every layer's parameters but the routed experts
    experts: float  # the routed experts: E / ep per MoE layer
    layer_params: float  # one MoE layer's, its local experts included (what ZeRO-3 gathers)
    act_per_token: float  # what a MoE layer keeps beyond a dense one, per token of a micro-batch
    flow_per_token: float  # gradients flowing in a MoE layer's backward beyond a dense one's


def _moe_rank(
    m: ModelConfig, p: ParallelConfig, cb: int, stage: int, imbalance: float, device: DeviceKind
) -> _MoERank:
    num_moe = _stage_moe_layers(m, p, stage)
    num_dense = _stage_layers(m.num_layers, p, stage) - num_moe
    moe_params = moe_layer_dense_params(m, p.tp)
    experts = local_expert_params(m, p.ep)
    factor = imbalance_factor(m, p, imbalance)
    # SwiGLU's backward holds 2 ffn-wide gradients (_flow_bytes): the experts' k copies instead
    grads = (
        2 * (m.moe_top_k * m.expert_ffn_size * factor + m.moe_shared_ffn_hidden_size - m.ffn_size) * cb / p.tp
    )
    return _MoERank(
        num_moe=num_moe, dense_params=num_dense * _layer_params(m, p.tp) + num_moe * moe_params,
        experts=num_moe * experts, layer_params=moe_params + experts,
        act_per_token=moe_activation_delta_per_token(m, p, cb, factor, grouped=device == "gpu"), flow_per_token=max(grads, 0.0) if num_moe else 0.0,
    )  # fmt: skip


def _stage_moe_layers(m: ModelConfig, p: ParallelConfig, stage: int) -> int:
    """MoE layers on the rank at pipeline coordinate `stage`: its layers past the first
    moe_dense_layers (dense), with _stage_layers' split."""
    base, extra = divmod(m.num_layers, p.num_stages)
    count = 0
    for i in range(stage, p.num_stages, p.pp):
        start = i * base + min(i, extra)
        end = start + base + (1 if i < extra else 0)
        count += max(0, end - max(start, m.moe_dense_layers))
    return count


def _forward_backward(
    p: ParallelConfig, r: _Rank, stage: int, sharded_grads: float
) -> tuple[float, float, float]:
    """(working copies, gradients, activations) at the forward/backward peak: the largest of a
    few moments of a micro-batch's passes."""
    # Gradients accumulate whole, in fp32, across micro-batches without synchronising: pipeline
    # stages (torch's pipelining syncs only the last backward), replicated DP (the trainer's
    # no_sync), no DP; FSDP2 reduce-scatters each micro-batch otherwise.
    accumulates = p.pp > 1 or p.zero_stage == 0
    accumulated = 4 * r.params + r.vocab_grad + 4 * r.experts if accumulates else sharded_grads
    working = r.root + 2 * r.unit if p.zero_stage == 3 else r.whole  # zero 3 prefetches the next layer
    # FSDP2's gathered weights are in the compute dtype, so are the gradients autograd gives them:
    # one layer's, until its post-backward folds them into the fp32 gradients. (Autocast's casts
    # hand theirs straight back to the fp32 parameters.)
    fresh = r.unit if p.dp * p.cp > 1 and r.cb < 4 else 0.0
    if p.virtual_stages > 1:
        return _interleaved_moments(p, r, stage, accumulated, working, fresh)
    n, inflight = p.num_microbatches, _in_flight(p, stage)
    # Every forward before the first backward (GPipe; 1F1B on a stage with n <= pp - stage; one
    # micro-batch): the peak can precede any gradient.
    first_backward = inflight >= n
    grads = 0.0 if first_backward else accumulated
    held = r.layers + r.head
    moments = [  # (working copies, gradients, activations)
        (working, grads + fresh, held * (inflight - 1) + r.layers + r.flow),  # in a layer's backward
    ]
    if r.head:  # the loss, every layer's activations still there
        moments.append((r.root if p.zero_stage == 3 else r.whole, grads, held * inflight + r.loss))
    if first_backward and n > 1:  # GPipe: the next backward, with the first's gradients
        moments.append((working, accumulated + fresh, held * (inflight - 2) + r.layers + r.flow))
        if r.head:  # ... and its loss, the later micro-batches' logits still there
            moments.append((r.whole, accumulated, held * (inflight - 1) + r.loss))
    if p.zero_stage == 3 and p.pp > 1:  # a backward that does not sync leaves its layers
        # gathered until their next forward: all of them at its last layer
        moments.append((r.whole, accumulated + fresh, held * (inflight - 1) + r.layer + r.flow))
    return max(moments, key=sum)


def _interleaved_moments(
    p: ParallelConfig, r: _Rank, stage: int, accumulated: float, working: float, fresh: float
) -> tuple[float, float, float]:
    """_forward_backward's peak for an interleaved rank, walked through the rank's own order of
    forwards and backwards (`interleaved_order`): its local stages differ (the head and its loss
    on the last rank's last one, the embedding on the first rank's first), a local stage's
    gradients exist once its first backward is done, and a rank's first backward comes after all of
    its first local stage's forwards but only some of its later ones."""
    last_rank = stage == p.pp - 1
    root_params = r.root / r.cb  # the embedding (first rank, local stage 0) or the head (last rank, last)
    layer_grads = accumulated - 4 * root_params - r.vocab_grad
    home = len(r.chunks) - 1 if last_rank else 0
    acts = [r.layers * f + (r.head if last_rank and j == home else 0.0) for j, f in enumerate(r.chunks)]
    grads_of = [
        layer_grads * f + ((4 * root_params + r.vocab_grad) if j == home else 0.0)
        for j, f in enumerate(r.chunks)
    ]
    # torch's runtime waits for its sends at the end of the step: each holds what it sent, a
    # local stage's output (also kept for its backward) or its input's gradient, until then.
    to_next = [stage + j * p.pp < p.num_stages - 1 for j in range(len(r.chunks))]
    to_previous = [stage + j * p.pp > 0 for j in range(len(r.chunks))]
    held, grads, started = 0.0, 0.0, set()
    # The peak moment by its sum, the first of equal ones: max(moments, key=sum), kept as it goes
    # (a + b + c is sum's order). The walk is a plan's hottest loop: the moments are inlined.
    best, best_sum = None, -math.inf
    zero3, layers, flow = p.zero_stage == 3, r.layers, r.flow
    for kind, j in _order(p.pp, p.virtual_stages, p.num_microbatches, stage):
        if kind == "F":
            held += acts[j] + (r.boundary if to_next[j] else 0.0)
            if last_rank and j == home:  # the loss, computed at the end of the last stage's forward
                a, b, c = r.root if zero3 else r.whole, grads, held + r.loss
                if a + b + c > best_sum:
                    best, best_sum = (a, b, c), a + b + c
            continue
        others = held - acts[j]
        b, c = grads + fresh, others + layers * r.chunks[j] + flow
        if working + b + c > best_sum:
            best, best_sum = (working, b, c), working + b + c
        if zero3:  # a backward that does not sync leaves its layers gathered (see above)
            c = others + r.layer + flow
            if r.whole + b + c > best_sum:
                best, best_sum = (r.whole, b, c), r.whole + b + c
        held = others + (r.boundary if to_previous[j] else 0.0)
        if j not in started:  # its gradients, whole and in fp32 until the step's last backward
            started.add(j)
            grads += grads_of[j]
    return best


def interleaved_order(pp: int, v: int, n: int, rank: int) -> list[tuple[str, int]]:
    """The forwards and backwards of pipeline rank `rank`, in torch's interleaved order (_order)."""
    return list(_order(pp, v, n, rank))


@functools.lru_cache(maxsize=4096)  # a plan asks the same few (pp, v, n, rank) for every layout
def _order(pp: int, v: int, n: int, rank: int) -> tuple[tuple[str, int], ...]:
    """The forwards ("F") and backwards ("B") of pipeline rank `rank` in the order torch's
    ScheduleInterleaved1F1B runs them, each with its local stage (0 .. v-1: stage rank + j pp):
    a warm-up of (v - 1) x round + 2 (pp - 1 - rank) forwards, rounds of n // max(1, n // pp)
    micro-batches per local stage (pp when pp divides n; torch.distributed.pipelining.schedules
    _get_warmup_ops), then one forward and one backward in turn, then the remaining backwards, the
    latest local stage first."""
    rounds = max(1, n // pp)
    per_round = n // rounds
    total = v * n
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - rank), total)
    order: list[tuple[str, int]] = []
    for op in range(total + warmup):
        if op < total:
            order.append(("F", (op // per_round) % v))
        if op >= warmup:
            order.append(("B", v - 1 - ((op - warmup) // per_round) % v))
    return tuple(order)


def _chunk_shares(num_layers: int, p: ParallelConfig, stage: int) -> tuple[float, ...]:
    """Each local stage's share of the layers of the rank at pipeline coordinate `stage`."""
    sizes = _local_stage_layers(num_layers, p, stage)
    total = sum(sizes)
    return tuple(x / total for x in sizes) if total else tuple(1.0 / len(sizes) for _ in sizes)


def _local_stage_layers(num_layers: int, p: ParallelConfig, stage: int) -> list[int]:
    """Layers of each local stage of the rank at pipeline coordinate `stage` (trainer/pipeline.py:
    contiguous ranges, earlier stages take the remainder; interleaved ranks hold stages r, r + pp,
    ...)."""
    base, extra = divmod(num_layers, p.num_stages)
    return [base + (1 if s < extra else 0) for s in range(stage, p.num_stages, p.pp)]


def _stage_layers(num_layers: int, p: ParallelConfig, stage: int) -> int:
    """Layers on the rank at pipeline coordinate `stage`, all its local stages."""
    return sum(_local_stage_layers(num_layers, p, stage))


def _in_flight(p: ParallelConfig, stage: int) -> float:
    """Micro-batches whose activations a rank holds at once (Narayanan et al. 2021 sec. 2.2):
    all of them with GPipe; with 1F1B min(pp - stage, m); interleaved, the first rank's warm-up of
    2(pp - 1) + (v - 1) pp + 1 chunks of L/(pp v) layers, i.e. x (1 + (pp - 1)/(pp v))
    (Korthikanti sec. 4.2.3); gradient accumulation one at a time."""
    n, pp, v = p.num_microbatches, p.pp, p.virtual_stages
    if pp == 1:
        return 1.0
    if p.pp_schedule == "gpipe":
        return float(n)
    if v > 1:  # the most local stages' forwards whose backward is still to come, torch's order
        held = peak = 0
        for kind, _ in _order(pp, v, n, stage):
            held += 1 if kind == "F" else -1
            peak = max(peak, held)
        return peak / v
    return float(min(pp - stage, n))
