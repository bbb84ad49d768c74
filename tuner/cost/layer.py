"""One decoder layer as a rank holds it: its parameters after tensor parallelism and the
activations it keeps per token for backward (Korthikanti et al. 2022, table 2, for this trainer's
modules; docs/perfmodel.md says where they differ from Megatron-LM's). The kinds of norm, MLP and
attention are asked for their facts (trainer/contract/blocks.py), never compared by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainer.contract.model import ModelConfig
from trainer.contract.parallel import ParallelConfig
from trainer.contract.rules import RECOMPUTE_MODULES, gathers_norms_again
from tuner.cost.context import keys_per_query

if TYPE_CHECKING:
    from trainer.contract.devices import DeviceKind
    from tuner.perfconstants import ModelConstants


def activation_bytes_per_token(
    m: ModelConfig, p: ParallelConfig, cb: int, c: ModelConstants, residual: int | None = None,
    device: DeviceKind = "gpu",
) -> float:  # fmt: skip
    """Bytes one layer stores per token of one micro-batch, as the trainer's block saves them;
    cb: the compute dtype's bytes, residual: the residual stream's (fp32 under autocast); device:
    where the kernels run (RMSNorm keeps other tensors on CPU than on CUDA, below).

    Without recompute (Korthikanti table 2 has 10 + 24/t 16-bit bytes x h): the layer input, the
    residual after attention and both norm outputs, replicated (8h in 16 bit); with sequence
    parallelism all four are sharded (8h/t): torch's SequenceParallel all-gathers before the
    linears, which would save the gathered input, but the trainer keeps the norm's output shard
    for them and gathers it again in backward, as Megatron-LM does (trainer/model.py
    gather_again; not under autocast, whose linears save their own casts of the gathered input:
    4h then, and not where the norms are recomputed anyway). Sharded over tp: q, k, v, the
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
    positions keep nothing (their products' other factor is the cos/sin buffer); GQA's k and v
    reach SDPA as their KV heads (enable_gqa: no repeat), which it keeps as they are: q and the
    output q_size wide, k and v kv_size (attention_tensors). The SwiGLU MLP keeps the gate's output (SiLU's
    input), SiLU's output, the up projection's output and their product (the down projection's
    input): 4 ffn/t where GELU keeps 2. Under autocast the gate and up projections each cast the
    second norm's output, as q, k and v cast the first's."""
    h, a, t = m.hidden_size, m.num_heads, p.tp
    res = residual or cb
    if p.tp_col > 1:
        return activation_bytes_per_token_2d(m, p, cb, c, res)
    shard = t if p.sequence_parallel else 1
    if p.activation_checkpoint == "full":
        return res * h / shard
    if p.activation_checkpoint == "op":
        return op_activation_bytes_per_token(m, p, cb, res, device)
    # Under autocast (an fp32 residual: no FSDP2 mixed precision) each linear casts its input
    # itself, so q, k and v save a copy each of the first norm's output where FSDP2's bf16
    # modules share one (and SwiGLU's gate and up projections of the second's).
    norms = (m.attention_kind.inputs + m.mlp_kind.inputs if res > cb else 2) * cb * h
    if res == cb and gathers_norms_again(p):  # the norms' output shards (trainer/model.py gather_again)
        norms /= t
    # the layer input and the residual after attention (what the norms keep of them); the norm outputs
    stream = 2 * norm_input_bytes(m, res, device) * h / shard + norms
    stats = 2 * 4 * m.norm_kind.stats / shard  # two norms' fp32 statistics per token (NormKind.stats)
    if "layernorm" in recomputed_modules(p):  # the norms' inputs only (their outputs: the casts
        # autocast's linears save, which are not the outputs, stay; trainer/model.py Block)
        stream, stats = 2 * res * h / shard + (norms if res > cb else 0.0), 0.0
    # q, k, v, attention output; the MLP's; latent attention's latents (whole on every tp rank)
    selective = p.activation_checkpoint == "selective"
    up = "mla_up_proj" in recomputed_modules(p)
    sharded = (attention_tensors(m, device, selective, up) + m.mlp_kind.kept * m.ffn_size) * cb / t
    sharded += latent_bytes(m, cb, res, device)
    lse = 0.0 if selective else 4 * a / t
    sharded += qk_norm_bytes(m, cb, res, device) / t
    scores = (
        0.0 if c.flash_attention else 5 * a * keys_per_query(m, p) / t * cb / 2
    )  # Korthikanti's 5as/h x h, 16 bit
    return stream + sharded + lse + stats + scores


def recomputed_modules(p: ParallelConfig) -> frozenset[str]:
    """Megatron's recompute modules a layout's activation_checkpoint names ("layernorm",
    "moe_act", "mla_up_proj" and their combinations; trainer/model.py Block and LatentAttention,
    trainer/moe.py GroupedExperts)."""
    return frozenset(p.activation_checkpoint.split("+")) & set(RECOMPUTE_MODULES)


def attention_tensors(
    m: ModelConfig, device: DeviceKind = "gpu", selective: bool = False, up_recomputed: bool = False
) -> int:
    """Width per token of what attention keeps over tp: q and the output, q_size each (h unless
    attention_head_dim widens it), k and v, kv_size each (their KV heads: SDPA's enable_gqa,
    trainer/model.py CoreAttention; 4 h with multi-head attention).

    Latent attention (DeepSeek-V2/V3, trainer/model.py LatentAttention): q and k of heads x
    (qk_nope + qk_rope), v (its own copy) and the output of heads x v_head_dim. On CPU, whose SDPA
    kernel needs v as wide as q, v is padded to q's width and so is SDPA's output, which the
    out-projection's input is then cut from (a copy): 4 q-wide tensors and one of the values'
    width; with the attention core recomputed (selective) the padded output is not kept. With
    Megatron's mla_up_proj (`up_recomputed`) q, k and v are left out, computed again from the
    latents in the backward: the output (and on CPU the out-projection's copy) only. The latents
    are latent_bytes."""
    if m.attention_kind.latent:
        qk = m.latent_qk_size
        padded = device == "cpu" and m.v_head_dim != m.qk_nope_head_dim + m.qk_rope_head_dim
        if up_recomputed:
            return qk + m.q_size if padded else m.q_size
        if padded:
            return (3 if selective else 4) * qk + m.q_size
        return 2 * qk + 2 * m.q_size
    return 2 * m.q_size + 2 * m.kv_size


def up_projection_flops_per_token(m: ModelConfig, tp: int) -> float:
    """Latent attention's up-projections' forward FLOPs a token on a rank (wq or wq_b, and wkv_b,
    column-parallel): what mla_up_proj runs again in the backward."""
    q_in = m.q_lora_rank or m.hidden_size
    return 2 * (q_in * m.latent_qk_size + m.kv_lora_rank * m.latent_kv_size) / tp


def latent_bytes(m: ModelConfig, cb: int, res: int, device: DeviceKind = "gpu") -> float:
    """What latent attention's latents keep per token, whole on every tensor-parallel rank: each
    latent norm's input and output (q's, q_lora_rank wide, and kv's; the up-projections read the
    outputs) and fp32 rstd a row. kv's norm reads a view of wkv_a's output, which holds the
    shared rotary key beside the latent: kept whole (kv_lora_rank + qk_rope_head_dim). On CPU,
    and under autocast, RMSNorm runs torch's composite: an fp32 copy of its input (the input
    itself, view and all, when it is fp32) and the fp32 normalised input (as norm_input_bytes)."""
    if not m.attention_kind.latent:
        return 0.0
    q, kv, r = m.q_lora_rank, m.kv_lora_rank, m.qk_rope_head_dim
    stats = 4 * (1 + (q > 0))
    if device == "cpu" or res > cb:
        return (8 + cb) * (q + kv) + (4 * r if cb == 4 else 0) + stats
    return cb * (2 * q + 2 * kv + r) + stats


def flow_bytes(m: ModelConfig, p: ParallelConfig, cb: int, res: int, tokens: int) -> float:
    """Gradients flowing in a layer's backward beyond what it keeps, for `tokens`: two of the
    residual stream's, and the MLP's: GELU's output's gradient (4h/t; its input's, which GELU's
    backward writes, takes the place of the down projection's input, freed by then); SwiGLU's
    product's gradient and the two it gives (SiLU's output's, up's), less the product freed:
    2 ffn/t in the compute dtype (found with the oracle at SwiGLU's backward: the four kept,
    less one, plus three)."""
    h, t, k = m.hidden_size, p.tp, p.tp_col
    if m.mlp_kind.gated:
        return tokens * (2 * h / k * res + 2 * m.ffn_size / t * cb)
    return tokens * (2 * h / k + 4 * h / t) * res


def qk_norm_bytes(m: ModelConfig, cb: int, res: int, device: DeviceKind) -> int:
    """What RMSNorm on q and k keeps per token (Qwen3's per head, OLMoE's over the projection),
    before tp: its input, q and k of their KV heads, and the fp32
    rstd of each normalised row. On CUDA `_fused_rms_norm` keeps the input itself; on CPU, and
    under autocast (fp32 norm weights beside bf16 q and k, where CUDA runs the composite too),
    the composite keeps an fp32 copy of the input and the fp32 normalised input."""
    if m.qk_norm == "none":
        return 0
    per_value = 8 if device == "cpu" or res > cb else cb
    rows = m.num_heads + m.num_kv_heads if m.qk_norm == "head" else 2
    return per_value * (m.q_size + m.kv_size) + 4 * rows


def norm_input_bytes(m: ModelConfig, res: int, device: DeviceKind) -> int:
    """Bytes per value a norm keeps of its input: the input itself (LayerNorm; RMSNorm on CUDA,
    `_fused_rms_norm`), or on CPU RMSNorm's composite: an fp32 copy of it (the fp32 input itself)
    and the fp32 normalised input."""
    return 4 + 4 if m.norm_kind.cpu_composite and device == "cpu" else res


def norm_2d_bytes(m: ModelConfig, res: int) -> int:
    """Bytes per column-split value a 2D norm keeps (trainer/tp2d.py writes it in torch ops): its
    fp32 input (a copy unless the input is fp32, then the layer input or the residual after
    attention), LayerNorm's centred fp32 input, the normalised output and the norm's output in the
    input's dtype."""
    return 4 + (4 if m.norm_kind.centred else 0) + 2 * res


def activation_bytes_per_token_2d(
    m: ModelConfig, p: ParallelConfig, cb: int, c: ModelConstants, res: int
) -> float:
    h, a, t, k = m.hidden_size, m.num_heads, p.tp, p.tp_col
    if p.activation_checkpoint == "full":
        return res * h / k
    norms = 2 * norm_2d_bytes(m, res) * h / k
    sharded = (attention_tensors(m) + m.mlp_kind.kept * m.ffn_size) * cb / t
    lse = 0.0 if p.activation_checkpoint == "selective" else 4 * a / t
    # per norm, fp32: its statistics and as many all-reduced sums (LayerNorm's mean, rstd, sum x
    # and sum x^2; RMSNorm's rstd and sum of squares)
    stats = 2 * 4 * (2 * m.norm_kind.stats)
    scores = 0.0 if c.flash_attention else 5 * a * keys_per_query(m, p) / t * cb / 2
    return norms + sharded + lse + stats + scores


def layer_params(m: ModelConfig, tp: int, tp_col: int = 1) -> float:
    """One layer's parameters on a rank: its matmul weights over tp x tp_col (latent attention's
    down-projections whole: ModelConfig.attention_replicated_params), the two norms' weight (and
    LayerNorm's bias; replicated over tp, split over tp_col), q/k/v's bias (Qwen2;
    column-parallel, over tp), the norms inside attention (replicated)."""
    whole = m.attention_replicated_params
    params = (m.num_layer_matmul_params - whole) / (tp * tp_col) + whole + 2 * m.norm_params / tp_col
    params += m.attention_norm_params
    if m.qkv_bias:
        params += (m.hidden_size + 2 * m.kv_size) / tp
    return params


# Op-level checkpointing ("op": trainer/parallelize.py op_sac_policy) ------------------------------


@dataclass(frozen=True)
class Op:
    """One op of a block's forward as op-level checkpointing sees it, per token of a micro-batch on
    this rank: `kind` "mm" (aten.mm: kept or recomputed in turn), "saved" (always kept: SDPA's CUDA
    kernels, addmm, bmm, topk, reduce-scatter) or "recomputed" (never kept: the router's matmul,
    the grouped GEMM, the CPU's SDPA kernel); the bytes of its output and its GEMM FLOPs."""

    kind: str
    bytes: float
    flops: float = 0.0


def op_checkpoint(ops: list[Op]) -> tuple[float, float]:
    """(bytes kept, GEMM FLOPs recomputed) per token of a block under torchtitan's policy
    (trainer/parallelize.py op_sac_policy): the outputs of the saved ops and of every other
    matmul, the first included; the matmuls in between and the never-kept GEMMs run again in
    backward."""
    kept = recomputed = 0.0
    mms = 0
    for op in ops:
        if op.kind == "mm":
            mms += 1
            if mms % 2:
                kept += op.bytes
            else:
                recomputed += op.flops
        elif op.kind == "saved":
            kept += op.bytes
        else:
            recomputed += op.flops
    return kept, recomputed


def _linear(width: float, flops_in: float, cb: int, bias: bool = False) -> Op:
    """A linear layer's output (width values a token) and its FLOPs from flops_in inputs a value:
    aten.mm without a bias, addmm (always kept) with one (F.linear folds a 3-D input to 2-D)."""
    return Op("saved" if bias else "mm", width * cb, 2 * flops_in * width)


def attention_ops(m: ModelConfig, p: ParallelConfig, cb: int, device: DeviceKind = "gpu") -> list[Op]:
    """The attention half of a block, in the trainer's order (trainer/model.py Attention): q, k and
    v (column-parallel: over tp; latent attention's projections, the latents' whole), SDPA (on GPUs its output and fp32 log-sum-exp per head, kept; the
    CPU's kernel is not in the policy's list: recomputed, no GEMM FLOPs counted here), the
    out-projection (row-parallel: every rank's partial sum is h wide), and under sequence
    parallelism its reduce-scatter (kept, h / tp)."""
    h, t = m.hidden_size, p.tp
    if m.attention_kind.latent:  # wq (or wq_a, whole, and wq_b), wkv_a (whole), wkv_b: LatentAttention
        qk = m.latent_qk_size / t
        q = (
            [_linear(m.q_lora_rank, h, cb), _linear(qk, m.q_lora_rank, cb)]
            if m.q_lora_rank
            else [_linear(qk, h, cb)]
        )
        kv_a = _linear(m.kv_lora_rank + m.qk_rope_head_dim, h, cb)
        ops = [*q, kv_a, _linear(m.latent_kv_size / t, m.kv_lora_rank, cb)]
    else:
        ops = [_linear(w / t, h, cb, m.qkv_bias) for w in (m.q_size, m.kv_size, m.kv_size)]
    ops.append(Op("saved" if device == "gpu" else "recomputed", m.q_size / t * cb + 4 * m.num_heads / t))
    ops.append(_linear(h, m.q_size / t, cb))
    if p.sequence_parallel:
        ops.append(Op("saved", h / t * cb))
    return ops


def mlp_ops(m: ModelConfig, p: ParallelConfig, cb: int, ffn: int, tp: int) -> list[Op]:
    """A dense MLP of width `ffn` over `tp` ranks: its input linears (SwiGLU's gate, then up; GELU's
    fc), the down projection (a partial sum, h wide), and its reduce-scatter under sequence
    parallelism when split over tp."""
    h = m.hidden_size
    ops = [_linear(ffn / tp, h, cb) for _ in range(m.mlp_kind.inputs)]
    ops.append(_linear(h, ffn / tp, cb))
    if p.sequence_parallel and tp > 1:
        ops.append(Op("saved", h / tp * cb))
    return ops


def weight_output_bytes_per_token(
    m: ModelConfig, p: ParallelConfig, cb: int, res: int | None = None, mlp: bool = True
) -> float:
    """What a split backward's input half keeps for its weight half in a dense block, per token
    of a micro-batch on this rank (torch.distributed.pipelining._backward stage_backward_input:
    the gradient at each op that takes a weight, its output's): the linears' outputs
    (attention_ops, mlp_ops; `mlp` False: attention's alone) in the compute dtype, and the two
    norms' (over tp with sequence parallelism) in the residual's (`res`: autocast runs the norms in
    fp32). With sequence parallelism the input half also all-gathers again the input of each
    column-parallel block (attention's q/k/v, the MLP's), whole, which the weight half's GEMMs
    take (the forward kept it sharded): measured on the memory oracle, 2026-12-07."""
    ops = attention_ops(m, p, cb) + (mlp_ops(m, p, cb, m.ffn_size, p.tp) if mlp else [])
    norms = 2 * m.hidden_size / (p.tp if p.sequence_parallel else 1) * (res or cb)
    regathered = (
        (2 if mlp else 1) * m.hidden_size / p.tp_col * cb if p.sequence_parallel and p.tp > 1 else 0.0
    )
    return sum(op.bytes for op in ops if op.flops) + norms + regathered


def op_activation_bytes_per_token(
    m: ModelConfig, p: ParallelConfig, cb: int, res: int, device: DeviceKind = "gpu"
) -> float:
    """A dense block's bytes per token under op-level checkpointing: its input (the checkpoint's,
    in the residual's dtype; over tp with sequence parallelism) and what op_checkpoint keeps of
    attention and the MLP. Norms, rotary positions, activations, all-gathers and
    all-reduces are recomputed."""
    shard = p.tp if p.sequence_parallel else 1
    kept, _ = op_checkpoint(attention_ops(m, p, cb, device) + mlp_ops(m, p, cb, m.ffn_size, p.tp))
    return res * m.hidden_size / shard + kept


def op_recomputed_flops_per_token(m: ModelConfig, p: ParallelConfig, cb: int) -> float:
    """The GEMM FLOPs op-level checkpointing runs again per token of a dense block (every other
    matmul)."""
    return op_checkpoint(attention_ops(m, p, cb) + mlp_ops(m, p, cb, m.ffn_size, p.tp))[1]
