"""A plain decoder: no process groups inside, parallelism is applied from outside (parallelize.py).

One class for both families (trainer/contract/model.py ModelConfig.family): GPT-2's block (LayerNorm, GELU
MLP, learned positions) and Llama's (RMSNorm, SwiGLU, rotary positions, grouped-query attention;
Mistral's is the same, Qwen2's adds a q/k/v bias), after torchtitan's Llama and nanoGPT. Rotary
positions follow Hugging Face's layout (rotate_half over the two halves of each head), so a
Hugging Face checkpoint's q and k weights load as they are.

Layers live in a ModuleDict keyed by layer id and the embedding, final norm and head may be None,
so a pipeline stage is this same class with parts removed (torchtitan's layout).

Context parallelism (trainer/context_parallel.py) sets, from outside, the global positions of the
tokens this rank holds (`GPT.positions`, for RoPE and learned positions) and a `CPComm` on each
attention, which then gathers K/V over the cp ranks; without it (cp 1) they are None.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate

from trainer.context_parallel import CPComm
from trainer.contract.blocks import ce_chunk_rows
from trainer.contract.model import ModelConfig
from trainer.moe import MoE, gather_again, local, recompute_without_output

INIT_STD = 0.02  # GPT-2


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)


class Embeddings(nn.Module):
    """Token embeddings, plus learned position embeddings (GPT; rotary positions live in attention)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos = nn.Embedding(cfg.seq_len, cfg.hidden_size) if cfg.positions == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.positions: torch.Tensor | None = None  # context parallelism: the tokens' global positions

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        if self.pos is not None:
            if self.positions is not None:
                positions = self.positions.to(idx.device)
            else:
                positions = torch.arange(idx.shape[1], device=idx.device)
            x = x + self.pos(positions)
        return self.drop(x)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """The rotary frequencies of one head (head_dim / 2), with Llama 3.1's scaling when configured:
    wavelengths beyond the original context / low_freq_factor slow down by `factor`, those under
    original / high_freq_factor stay, the band between is interpolated (Hugging Face's
    _compute_llama3_parameters, Meta's apply_scaling)."""
    d = cfg.rope_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).double() / d))
    if cfg.rope_scaling_factor is None:
        return inv_freq.float()
    factor, low, high = cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    original = cfg.rope_original_max_positions
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(medium, smoothed, scaled).float()


def rope_cos_sin(
    cfg: ModelConfig, device: torch.device | None = None, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """cos and sin of every position's angles, stacked: (2, seq_len, rope_dim), fp32; of the given
    `positions` only (context parallelism: a rank's tokens), in their order."""
    if positions is None:
        positions = torch.arange(cfg.seq_len, dtype=torch.float32, device=device)
    else:
        positions = positions.to(device=device, dtype=torch.float32)
    angles = torch.outer(positions, rope_inv_freq(cfg).to(device))
    angles = torch.cat((angles, angles), dim=-1)
    return torch.stack((angles.cos(), angles.sin()))


def apply_rope(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, T, head_dim) rotated by position: x cos + rotate_half(x) sin, in fp32."""
    cos, sin = cos_sin[0, : x.shape[2]], cos_sin[1, : x.shape[2]]
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x.float() * cos + rotated * sin).type_as(x)


class CoreAttention(nn.Module):
    """softmax(QK^T/sqrt(d))V, causal. A module of its own so that selective activation
    checkpointing can recompute exactly this part (Korthikanti et al. 2022) and no collective."""

    def __init__(self, dropout: float):
        super().__init__()
        self.dropout = dropout
        self.cp: CPComm | None = None  # context parallelism: local queries, the whole sequence's K/V

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        if self.cp is not None:
            return self.cp.attention(q, k, v, p)
        gqa = k.shape[1] != q.shape[1]
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, enable_gqa=gqa)


class Attention(nn.Module):
    """Multi-head or grouped-query attention (num_kv_heads < num_heads: each KV head serves
    num_heads / num_kv_heads query heads; Ainslie et al. 2023), rotary positions when configured.
    Heads may be wider than hidden / heads (attention_head_dim: Qwen3's 32 x 128 on a 2048 stream).
    q/k norms (RMSNorm before the rotation): per head over head_dim (Qwen3, "head"), or over the
    whole q and k projections (OLMoE, "proj")."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.attention_kind.latent:  # not plain attention in its place: LatentAttention is
            raise ValueError(f"attention {cfg.attention!r} is LatentAttention's, not Attention's")
        h, kv = cfg.hidden_size, cfg.kv_size
        self.head_dim = cfg.head_dim
        self.rope = cfg.positions == "rope"
        # Separate q/k/v so that column-parallel sharding splits whole (query and KV) heads.
        self.wq = nn.Linear(h, cfg.q_size, bias=cfg.qkv_bias)
        self.wk = nn.Linear(h, kv, bias=cfg.qkv_bias)
        self.wv = nn.Linear(h, kv, bias=cfg.qkv_bias)
        self.qk_norm = cfg.qk_norm
        widths = {"none": None, "head": (self.head_dim, self.head_dim), "proj": (cfg.q_size, kv)}[cfg.qk_norm]
        self.q_norm = nn.RMSNorm(widths[0], eps=cfg.norm_eps) if widths else None
        self.k_norm = nn.RMSNorm(widths[1], eps=cfg.norm_eps) if widths else None
        self.core = CoreAttention(cfg.dropout)
        self.wo = nn.Linear(cfg.q_size, h, bias=False)
        self.drop = nn.Dropout(cfg.dropout)
        self.cp: CPComm | None = None

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        if self.qk_norm == "proj":  # over all heads (refused with tp > 1: heads are split)
            q, k = self.q_norm(q), self.k_norm(k)
        # Under tensor parallelism q, k and v are this rank's heads only: derive the counts from them.
        q, k, v = (z.view(b, t, -1, self.head_dim) for z in (q, k, v))
        if self.qk_norm == "head":  # replicated weights under TP: each rank's heads add to their gradient
            q, k = (_rms_norm(z, norm) for z, norm in ((q, self.q_norm), (k, self.k_norm)))
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        if self.rope:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        if self.cp is not None:  # every cp rank's keys and values, KV heads only
            k, v = self.cp.gather(k), self.cp.gather(v)
        # GQA: SDPA's enable_gqa serves each KV head's group of query heads without repeating k
        # and v (its kernels keep the KV heads only; before issue 37 a repeat_interleave here made
        # SDPA keep num_heads / num_kv_heads copies, as Megatron's and flash-attn's kernels do not)
        y = self.core(q, k, v).transpose(1, 2).reshape(b, t, -1)
        return self.drop(self.wo(y))


def sdpa_needs_equal_widths(device: torch.device) -> bool:
    """SDPA's CPU kernel takes q, k and v of one width only (narrower values fall back to its math
    path); CUDA's memory-efficient and cuDNN kernels take v narrower (trainer/memcheck.py's GPU
    simulation runs as CUDA does)."""
    return device.type == "cpu"


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """(..., d) pairs (x0, x1, x2, x3, ...) -> halves (x0, x2, ..., x1, x3, ...): DeepSeek's rotary
    dims are interleaved pairs (its complex rotation; transformers' rope_interleave); as halves
    apply_rope's rotate_half turns each pair by its angle."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


class LatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2 section 2.1, V3): q through a rank-q_lora_rank
    bottleneck (wq_a, its RMSNorm, wq_b; or one wq with q_lora_rank 0), k and v up-projected by
    wkv_b from one normalised kv_lora_rank latent, which wkv_a computes beside a rotary key of
    qk_rope_head_dim shared by every head. Each head scores [nope | rope] of q against
    [nope | the shared rope key] (1/sqrt(nope + rope)) and returns v_head_dim values; transformers'
    DeepseekV3Attention with rope_interleave (its default), names aside.

    Tensor parallelism (trainer/parallelize.py apply_tp, torchtitan's deepseek_v3 plan): wq / wq_b
    and wkv_b column-parallel over whole heads, wo row-parallel; the latents (wq_a, wkv_a and
    their norms) replicated, computed whole on every rank. Their gradients are whole too: the
    column-parallel inputs all-reduce theirs (Megatron's f), and the shared rotary key, which only
    this rank's heads read, all-reduces its own (`tp_mesh`, set by apply_tp).

    SDPA's CPU kernel needs one width for q, k and v: on CPU v is zero-padded to q's width and
    the output cut back (without, SDPA falls back to its math path, which keeps the s x s
    probabilities); CUDA's memory-efficient and cuDNN kernels take v as it is, copied out of kv
    (a view would keep all of kv, nope keys included, for the backward). What it keeps a token:
    tuner/cost/layer.py attention_tensors and latent_bytes."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, heads = cfg.hidden_size, cfg.num_heads
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        qk = heads * (self.nope + self.rope_dim)
        if cfg.q_lora_rank:
            self.wq = None
            self.wq_a = nn.Linear(h, cfg.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(cfg.q_lora_rank, eps=cfg.norm_eps)
            self.wq_b = nn.Linear(cfg.q_lora_rank, qk, bias=False)
        else:
            self.wq, self.wq_a, self.q_norm, self.wq_b = nn.Linear(h, qk, bias=False), None, None, None
        self.wkv_a = nn.Linear(h, cfg.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_norm = nn.RMSNorm(cfg.kv_lora_rank, eps=cfg.norm_eps)
        self.wkv_b = nn.Linear(cfg.kv_lora_rank, heads * (self.nope + self.v_dim), bias=False)
        self.core = CoreAttention(cfg.dropout)
        self.wo = nn.Linear(cfg.q_size, h, bias=False)
        self.drop = nn.Dropout(cfg.dropout)
        self.cp: CPComm | None = None
        self.tp_mesh: DeviceMesh | None = None
        # activation_checkpoint mla_up_proj (trainer/parallelize.py apply_ac): q, k and v left out
        # of the graph and computed again from the latents in the backward
        self.recompute_up = False

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None = None) -> torch.Tensor:
        x = local(x)  # sequence parallelism hands a replicated DTensor: its gradient is whole (above)
        b, t, _ = x.shape
        q_in = x if self.wq is not None else self.q_norm(self.wq_a(x))
        latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv_in = self.kv_norm(latent)
        if self.tp_mesh is not None:  # the shared key's gradient: this rank's heads' share of a sum
            k_rope = DTensor.from_local(k_rope, self.tp_mesh, [Replicate()], run_check=False)
            k_rope = k_rope.to_local(grad_placements=[Partial()])
        if self.recompute_up:  # Megatron's mla_up_proj: q, k and v again from the latents in backward
            return recompute_without_output(
                self._up, (q_in, kv_in, k_rope, rope), lambda qkv: self._attend(*qkv, b, t)
            )
        return self._attend(*self._up(q_in, kv_in, k_rope, rope), b, t)

    def _up(
        self, q_in: torch.Tensor, kv_in: torch.Tensor, k_rope: torch.Tensor, rope: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k and v of this rank's heads (B, heads, T, width) from the normalised latents (or, with
        no q bottleneck, the input) and the shared rotary key."""
        q = self.wq(q_in) if self.wq is not None else self.wq_b(q_in)
        b, t = q.shape[:2]
        # Under tensor parallelism q and kv are this rank's heads only: derive the count from them.
        q = q.view(b, t, -1, self.nope + self.rope_dim).transpose(1, 2)
        heads = q.shape[1]
        kv = self.wkv_b(kv_in).view(b, t, heads, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q_nope, q_rope = q.split([self.nope, self.rope_dim], dim=-1)
        q_rope = apply_rope(deinterleave(q_rope), rope)
        k_rope = apply_rope(deinterleave(k_rope.unsqueeze(1)), rope)
        q = torch.cat((q_nope, q_rope), dim=-1)
        k = torch.cat((k_nope, k_rope.expand(-1, heads, -1, -1)), dim=-1)
        width = q.shape[-1]
        if sdpa_needs_equal_widths(q.device) and self.v_dim != width:
            v = F.pad(v, (0, width - self.v_dim))
        else:  # v of its own, so that SDPA keeps v_head_dim a head, not the whole kv it is a view of
            v = v.contiguous()
        return q, k, v

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: int, t: int) -> torch.Tensor:
        if self.cp is not None:  # every cp rank's keys and values
            k, v = self.cp.gather(k), self.cp.gather(v)
        y = self.core(q, k, v)[..., : self.v_dim].transpose(1, 2).reshape(b, t, -1)
        return self.drop(self.wo(y))


def _rms_norm(x: torch.Tensor, norm: nn.RMSNorm) -> torch.Tensor:
    return F.rms_norm(x, norm.normalized_shape, local(norm.weight, partial_grad=True), norm.eps)


class MLP(nn.Module):
    """GELU (GPT-2): proj(gelu(fc x)). SwiGLU (Shazeer 2020; Llama): proj(silu(gate x) * fc x),
    the gate and fc (Llama's w1 and w3) both column-parallel under tensor parallelism. A mixture
    of experts' shared expert is one of these of its own width."""

    def __init__(self, cfg: ModelConfig, ffn_size: int | None = None):
        super().__init__()
        f = ffn_size or cfg.ffn_size
        self.gate = nn.Linear(cfg.hidden_size, f, bias=False) if cfg.mlp == "swiglu" else None
        self.fc = nn.Linear(cfg.hidden_size, f, bias=False)
        self.proj = nn.Linear(f, cfg.hidden_size, bias=False)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            return self.drop(self.proj(F.silu(self.gate(x)) * self.fc(x)))
        return self.drop(self.proj(F.gelu(self.fc(x), approximate="tanh")))


class Block(nn.Module):
    """Pre-norm transformer block (GPT-2, Llama); in a mixture of experts, layers from
    moe_dense_layers on have experts (trainer/moe.py) in place of the MLP."""

    def __init__(self, cfg: ModelConfig, layer_id: int = 0):
        super().__init__()
        self.attn_norm = make_norm(cfg)
        self.attn = LatentAttention(cfg) if cfg.attention_kind.latent else Attention(cfg)
        self.mlp_norm = make_norm(cfg)
        experts = cfg.moe and layer_id >= cfg.moe_dense_layers
        self.mlp = None if experts else MLP(cfg)
        shared = (
            MLP(cfg, cfg.moe_shared_ffn_hidden_size) if experts and cfg.moe_shared_ffn_hidden_size else None
        )
        self.moe = MoE(cfg, layer_id, shared) if experts else None
        # activation_checkpoint layernorm: the norms' outputs left out of the graph, recomputed
        # (and gathered again with sequence parallelism) in the backward (recompute_without_output)
        self.recompute_norms = False
        # sequence parallelism (trainer/parallelize.py): what attention's and a dense MLP's linears
        # save of their all-gathered input is kept as the norm's output shard and gathered again
        # in the backward (gather_again), as Megatron-LM's sequence parallelism keeps it. A MoE
        # takes its tokens as the shard: nothing gathered to leave out. Not under autocast, whose
        # linears save their own casts of the gathered input (the shard would be kept besides).
        self.gather_norms_again = False

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None = None) -> torch.Tensor:
        mlp = self.mlp if self.mlp is not None else self.moe
        if self.recompute_norms:
            x = x + recompute_without_output(self.attn_norm, (x,), lambda y: self.attn(y, rope), self.attn)
            return x + recompute_without_output(self.mlp_norm, (x,), mlp, mlp)
        if self.gather_norms_again and not torch.is_autocast_enabled(x.device.type):
            x = x + gather_again(self.attn_norm, (x,), lambda y: self.attn(y, rope), self.attn)
            if self.mlp is not None:
                return x + gather_again(self.mlp_norm, (x,), self.mlp, self.mlp)
            return x + mlp(self.mlp_norm(x))
        x = x + self.attn(self.attn_norm(x), rope)
        return x + mlp(self.mlp_norm(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed: Embeddings | None = Embeddings(cfg)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.num_layers)})
        self.norm: nn.Module | None = make_norm(cfg)
        self.head: nn.Linear | None = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:  # one weight; a pipeline's first and last stage each hold a copy
            self.head.weight = self.embed.tok.weight
        # Rotary cos/sin, shared by every layer of this stage (not a parameter, not saved).
        self.register_buffer("rope", rope_cos_sin(cfg) if cfg.positions == "rope" else None, persistent=False)
        self.positions: torch.Tensor | None = None  # set_positions (context parallelism)

    def set_positions(self, positions: torch.Tensor) -> None:
        """Hold only the tokens at these global positions (context parallelism): the rotary table
        and the learned position embeddings follow them."""
        self.positions = positions
        if self.embed is not None:
            self.embed.positions = positions
        if self.rope is not None:
            self.rope = rope_cos_sin(self.cfg, self.rope.device, positions)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, V); a pipeline stage maps whatever it holds."""
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers.values():
            x = layer(x, self.rope)
        if self.norm is not None:
            x = self.norm(x)
        if self.head is not None:
            x = self.head(x)
        return x

    def init_buffers(self) -> None:
        """Recompute the buffers where the parameters are (after to_empty() from meta)."""
        if self.rope is not None:
            self.rope = rope_cos_sin(self.cfg, self.rope.device, self.positions)
        for name, buffer in self.named_buffers():
            if name.endswith(("expert_bias", "tokens_per_expert", "aux_loss")):
                buffer.zero_()

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Parameters are visited in a fixed order, so one seeded generator gives every layout
        the same full weights before they are sharded."""
        for name, p in self.named_parameters():
            init_param_(name, p, self.cfg, generator)


@torch.no_grad()
def init_param_(
    name: str, p: torch.Tensor, cfg: ModelConfig, generator: torch.Generator | None = None
) -> None:
    """GPT-2 init: N(0, 0.02), residual projections scaled by 1/sqrt(2L), norms at (1, 0), biases
    0. `p` may be a whole parameter or one rank's shard of it."""
    if "norm" in name or name.endswith(".bias"):
        p.fill_(1.0 if "norm" in name and name.endswith("weight") else 0.0)
    else:
        std = (
            INIT_STD / math.sqrt(2 * cfg.num_layers)
            if name.endswith(("wo.weight", "proj.weight", "experts.w2"))
            else INIT_STD
        )
        p.normal_(0.0, std, generator=generator)


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token loss in fp32. Vocab-sharded DTensor logits (tensor parallelism, inside
    loss_parallel()) go through torch's cross_entropy; whole ones through ChunkedCrossEntropy."""
    if isinstance(logits, DTensor):
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))
    return ChunkedCrossEntropy.apply(logits.flatten(0, 1), targets.flatten(0, 1))


class ChunkedCrossEntropy(torch.autograd.Function):
    """The mean cross entropy of (N, V) logits in fp32, a chunk of rows at a time, keeping for the
    backward the logits as they are and each row's log-sum-exp (4 bytes), and computing the
    gradient chunk by chunk into one tensor of the logits' dtype. torch's cross_entropy on the
    logits' fp32 copy keeps the fp32 log-softmax (4 bytes a value) and its backward holds two more
    fp32 tensors of the logits' size; Megatron-LM's fused cross entropy keeps its fp32 softmax.
    Here: the logits (2 bytes a value in bf16), plus one fp32 chunk while it runs, plus the
    gradient (2) in the backward."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        n, v = logits.shape
        rows = ce_chunk_rows(v)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        for s in range(0, n, rows):
            z = logits[s : s + rows].to(torch.float32, copy=True)
            picked = z.gather(1, targets[s : s + rows, None]).squeeze(1)
            top = z.amax(-1, keepdim=True)
            chunk_lse = z.sub_(top).exp_().sum(-1).log_().add_(top.squeeze(1))
            lse[s : s + rows] = chunk_lse
            total += (chunk_lse - picked).sum()
            del z  # before the next chunk's copy: one fp32 chunk at a time
        ctx.save_for_backward(logits, targets, lse)
        return total / n

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, targets, lse = ctx.saved_tensors
        n, v = logits.shape
        rows = ce_chunk_rows(v)
        out = torch.empty_like(logits)
        scale = grad.to(torch.float32) / n
        for s in range(0, n, rows):
            z = logits[s : s + rows].to(torch.float32, copy=True)
            z.sub_(lse[s : s + rows, None]).exp_()  # softmax
            z.scatter_add_(1, targets[s : s + rows, None], torch.full_like(z[:, :1], -1.0))
            out[s : s + rows] = z.mul_(scale)
            del z
        return out, None
