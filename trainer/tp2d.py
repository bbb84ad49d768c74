"""2D tensor parallelism (AxoNN: Singh et al. 2023, arXiv 2305.13525): every weight split over a
row group of `tp` ranks and a column group of `tp_col` ranks, applied from outside the plain GPT.

A normal layer W[out, in] holds out/tp x in/tp_col: its input is split over the column group
(features), so Y = X W^T is a partial sum there and is all-reduced over the column group; in
backward dX = dY W is a partial sum over the row group and is all-reduced there. A transposed
layer swaps the two groups. q/k/v and MLP-up are normal, attention-out and MLP-down transposed,
so a block maps a column-split residual stream to a column-split one with no re-layout between
them; heads and the MLP's ffn are split over the row group.

Collectives per linear layer, as AxoNN schedules them (not DTensor's default plan, which on the
same placements picks reduce-scatters and all-gathers): forward one all-reduce of Y over its
reduce group, backward one all-reduce of dX over the other. q, k and v read the same input, so
their three dX are summed first and all-reduced once (AxoNN's fused QKV layer: one all-reduce of
h/tp_col per token over the row group, not three). Activations are plain local tensors
between layers (the pattern of torch's ColwiseParallel/RowwiseParallel); only parameters are
DTensors, so FSDP2, replicate, the optimizer and the gradient norm see them as usual. Overlap: the
backward all-reduce of dX runs asynchronously while dW = dY^T X is computed (attention-out,
MLP-up and MLP-down; q, k and v's shared one starts once their three weight gradients are done,
and does not overlap); the forward all-reduce of Y blocks (the next op needs Y). With FSDP2 its own all-gather prefetch and
reduce-scatter overlap as in every other layout.

Everything else keeps the model the same GPT: LayerNorm (or RMSNorm) over the column-split hidden
dim reduces its statistics over the column group; the token embedding is vocab-split over the row
group (masked lookup, all-reduced) and hidden-split over the column group; the head is a normal
layer whose logits stay vocab-split over the row group for loss_parallel.

Llama's block: k and v are normal layers of kv_size outputs, split over the row group by whole KV
heads (tp divides num_kv_heads, as in 1D), so rank r's query heads find their KV heads on rank r;
rotary positions need nothing (whole heads, whole sequences on every rank). SwiGLU's gate and fc
are normal layers reading the same input: like q, k and v, their two dX are summed and all-reduced
once. A q/k/v bias is split with its layer's outputs over the row group and replicated over the
column group, where Y is whole after its all-reduce. A tied head is a normal layer holding the
embedding's own Parameter: both are vocab rows over the row group and hidden over the column group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement

from trainer.model import GPT

Group = dist.ProcessGroup | None


class _Linear(torch.autograd.Function):
    """Y = all_reduce(X W^T, fwd_group); dX = all_reduce(dY W, bwd_group), overlapped with dW."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, fwd_group: Group, bwd_group: Group) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.bwd_group = bwd_group
        y = F.linear(x, w)
        if fwd_group is not None:
            dist.all_reduce(y, group=fwd_group)
        return y

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, dy: torch.Tensor):
        x, w = ctx.saved_tensors
        dx = dy @ w
        work = dist.all_reduce(dx, group=ctx.bwd_group, async_op=True) if ctx.bwd_group is not None else None
        dw = dy.reshape(-1, dy.shape[-1]).T @ x.reshape(-1, x.shape[-1])
        if work is not None:
            work.wait()
        return dx, dw, None, None


class _AllReduceForward(torch.autograd.Function):
    """Megatron's g: all-reduce in forward, identity in backward (the gradient is already whole)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        return dy, None


class _AllReduceBackward(torch.autograd.Function):
    """Megatron's f: identity in forward, all-reduce in backward. Put before q, k and v (whose own
    backward does not reduce), it all-reduces the sum of their three input gradients once."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        dy = dy.contiguous().clone()
        dist.all_reduce(dy, group=ctx.group)
        return dy, None


class _AllReduceSum(torch.autograd.Function):
    """All-reduce in forward and backward: every rank's partial contributes to a shared sum."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        dy = dy.contiguous().clone()
        dist.all_reduce(dy, group=ctx.group)
        return dy, None


class Linear2D(nn.Module):
    """A linear layer over the row x column groups; `weight` (and `bias`) keep their FQNs. The bias
    (normal layers only) is added to Y once Y is whole over the column group."""

    def __init__(
        self,
        weight: nn.Parameter,
        fwd_group: Group,
        bwd_group: Group,
        logits_mesh: DeviceMesh | None,
        bias: nn.Parameter | None = None,
    ):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.fwd_group, self.bwd_group, self.logits_mesh = fwd_group, bwd_group, logits_mesh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _Linear.apply(x, self.weight.to_local(), self.fwd_group, self.bwd_group)
        if self.bias is not None:
            y = y + self.bias.to_local()
        if self.logits_mesh is not None:  # the head: vocab-split logits for loss_parallel
            return DTensor.from_local(y, self.logits_mesh, [Shard(-1)], run_check=False)
        return y


class LayerNorm2D(nn.Module):
    """LayerNorm over a hidden dim split across the column group: sum(x) and sum(x^2) are
    all-reduced there (one collective each way), so every rank normalises with the full row's
    statistics, as one process does."""

    def __init__(
        self, norm: nn.LayerNorm, weight: nn.Parameter, bias: nn.Parameter, group: dist.ProcessGroup
    ):
        super().__init__()
        self.weight, self.bias, self.group = weight, bias, group
        self.eps, self.hidden_size = norm.eps, norm.normalized_shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        sums = _AllReduceSum.apply(torch.stack([xf.sum(-1), (xf * xf).sum(-1)]), self.group)
        mean = (sums[0] / self.hidden_size).unsqueeze(-1)
        var = (sums[1] / self.hidden_size).unsqueeze(-1) - mean * mean
        y = ((xf - mean) * torch.rsqrt(var + self.eps)).to(x.dtype)
        return y * self.weight.to_local() + self.bias.to_local()


class RMSNorm2D(nn.Module):
    """RMSNorm (Zhang and Sennrich 2019; Llama) over a hidden dim split across the column group:
    sum(x^2) is all-reduced there, so every rank scales by the full row's root mean square."""

    def __init__(self, norm: nn.RMSNorm, weight: nn.Parameter, group: dist.ProcessGroup):
        super().__init__()
        self.weight, self.group = weight, group
        self.eps, self.hidden_size = norm.eps, norm.normalized_shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        mean_sq = _AllReduceSum.apply((xf * xf).sum(-1), self.group) / self.hidden_size
        y = (xf * torch.rsqrt(mean_sq.unsqueeze(-1) + self.eps)).to(x.dtype)
        return y * self.weight.to_local()


class Embedding2D(nn.Module):
    """An embedding split over the row group by vocabulary (each rank looks up its own rows,
    zeros elsewhere, then all-reduces: Megatron's VocabParallelEmbedding) and over the column
    group by hidden dim. Position embeddings (row_group None) are hidden-split only."""

    def __init__(self, weight: nn.Parameter, row_group: Group, vocab_start: int):
        super().__init__()
        self.weight, self.row_group, self.vocab_start = weight, row_group, vocab_start

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        w = self.weight.to_local()
        if self.row_group is None:
            return F.embedding(idx, w)
        start = self.vocab_start
        outside = (idx < start) | (idx >= start + w.shape[0])
        out = F.embedding((idx - start).masked_fill(outside, 0), w).masked_fill(outside.unsqueeze(-1), 0.0)
        return _AllReduceForward.apply(out, self.row_group)


def apply_tp_2d(model: GPT, mesh: DeviceMesh) -> None:
    """Swap the GPT's linear layers, norms and embeddings for their 2D versions, in place.
    `mesh` has the tensor-parallel axes of degree > 1: ("tp_col",) or ("tp", "tp_col")."""
    plan = _Plan(mesh)
    if model.embed is not None:
        model.embed.tok = plan.embedding(model.embed.tok, vocab_split=True)
        if model.embed.pos is not None:
            model.embed.pos = plan.embedding(model.embed.pos, vocab_split=False)
    for block in model.layers.values():
        block.attn_norm, block.mlp_norm = plan.norm(block.attn_norm), plan.norm(block.mlp_norm)
        plan.fused_inputs(block.attn, ("wq", "wk", "wv"))
        block.attn.wo = plan.linear(block.attn.wo, transposed=True)
        if block.mlp.gate is not None:  # SwiGLU: gate and fc read the same input
            plan.fused_inputs(block.mlp, ("gate", "fc"))
        else:
            block.mlp.fc = plan.linear(block.mlp.fc, transposed=False)
        block.mlp.proj = plan.linear(block.mlp.proj, transposed=True)
    if model.norm is not None:
        model.norm = plan.norm(model.norm)
    if model.head is not None:
        tied = model.cfg.tie_embeddings and model.embed is not None  # else a copy (pipeline.py)
        model.head = plan.linear(
            model.head, transposed=False, logits=True, weight=model.embed.tok.weight if tied else None
        )


class _Plan:
    """Placements and process groups of one mesh: row axis "tp" (may be absent), column "tp_col"."""

    def __init__(self, mesh: DeviceMesh):
        self.mesh = mesh
        names = mesh.mesh_dim_names
        self.row: Group = mesh.get_group("tp") if "tp" in names else None
        self.col: dist.ProcessGroup = mesh.get_group("tp_col")

    def _param(self, p: torch.Tensor, row: Placement, col: Placement) -> nn.Parameter:
        """`p` (whole, the same on every rank) cut to this rank's block without communication."""
        by_axis = {"tp": row, "tp_col": col}
        placements = [by_axis[a] for a in self.mesh.mesh_dim_names]
        return nn.Parameter(distribute_tensor(p.data, self.mesh, placements, src_data_rank=None))

    def reduce_input_gradient(self, module: nn.Module, args: tuple) -> tuple:
        """Forward pre-hook: the module's input through Megatron's f over the row group."""
        return (_AllReduceBackward.apply(args[0], self.row), *args[1:])

    def fused_inputs(self, module: nn.Module, names: tuple[str, ...]) -> None:
        """Normal layers of `module` that read its input (q, k, v; SwiGLU's gate and fc): their
        dX are summed by autograd and all-reduced once over the row group, at the module's input
        (AxoNN's fused QKV layer)."""
        for name in names:
            setattr(module, name, self.linear(getattr(module, name), transposed=False, reduce_dx=False))
        if self.row is not None:
            module.register_forward_pre_hook(self.reduce_input_gradient)

    def linear(
        self,
        layer: nn.Linear,
        *,
        transposed: bool,
        logits: bool = False,
        reduce_dx: bool = True,
        weight: nn.Parameter | None = None,
    ) -> Linear2D:
        """`weight`: a Parameter already placed as this layer's would be (a tied embedding's)."""
        if transposed:  # in-features over the row group, out over the column group
            assert layer.bias is None, "out-proj and MLP-down have no bias in either family"
            w = self._param(layer.weight, Shard(1), Shard(0))
            return Linear2D(w, fwd_group=self.row, bwd_group=self.col, logits_mesh=None)
        w = weight if weight is not None else self._param(layer.weight, Shard(0), Shard(1))
        bias = self._param(layer.bias, Shard(0), Replicate()) if layer.bias is not None else None
        logits_mesh = self.mesh["tp"] if logits and self.row is not None else None
        return Linear2D(
            w,
            fwd_group=self.col,
            bwd_group=self.row if reduce_dx else None,
            logits_mesh=logits_mesh,
            bias=bias,
        )

    def norm(self, norm: nn.Module) -> LayerNorm2D | RMSNorm2D:
        weight = self._param(norm.weight, Replicate(), Shard(0))
        if isinstance(norm, nn.RMSNorm):
            return RMSNorm2D(norm, weight, self.col)
        bias = self._param(norm.bias, Replicate(), Shard(0))
        return LayerNorm2D(norm, weight, bias, self.col)

    def embedding(self, emb: nn.Embedding, *, vocab_split: bool) -> Embedding2D:
        split = vocab_split and self.row is not None
        weight = self._param(emb.weight, Shard(0) if split else Replicate(), Shard(1))
        start = self.mesh.get_local_rank("tp") * weight.to_local().shape[0] if split else 0
        return Embedding2D(weight, self.row if split else None, start)
