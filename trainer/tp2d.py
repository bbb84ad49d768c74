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

Everything else keeps the model the same GPT: LayerNorm over the column-split hidden dim reduces
its statistics over the column group; the token embedding is vocab-split over the row group
(masked lookup, all-reduced) and hidden-split over the column group; the head is a normal layer
whose logits stay vocab-split over the row group for loss_parallel.
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
    """A bias-free linear layer over the row x column groups; `weight` keeps its FQN."""

    def __init__(
        self, weight: nn.Parameter, fwd_group: Group, bwd_group: Group, logits_mesh: DeviceMesh | None
    ):
        super().__init__()
        self.weight = weight
        self.fwd_group, self.bwd_group, self.logits_mesh = fwd_group, bwd_group, logits_mesh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _Linear.apply(x, self.weight.to_local(), self.fwd_group, self.bwd_group)
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
        model.embed.pos = plan.embedding(model.embed.pos, vocab_split=False)
    for block in model.layers.values():
        block.attn_norm, block.mlp_norm = plan.norm(block.attn_norm), plan.norm(block.mlp_norm)
        for name in ("wq", "wk", "wv"):  # their dX all-reduced once, at the attention's input
            setattr(
                block.attn, name, plan.linear(getattr(block.attn, name), transposed=False, reduce_dx=False)
            )
        if plan.row is not None:
            block.attn.register_forward_pre_hook(plan.reduce_input_gradient)
        block.attn.wo = plan.linear(block.attn.wo, transposed=True)
        block.mlp.fc = plan.linear(block.mlp.fc, transposed=False)
        block.mlp.proj = plan.linear(block.mlp.proj, transposed=True)
    if model.norm is not None:
        model.norm = plan.norm(model.norm)
    if model.head is not None:
        model.head = plan.linear(model.head, transposed=False, logits=True)


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

    def linear(
        self, layer: nn.Linear, *, transposed: bool, logits: bool = False, reduce_dx: bool = True
    ) -> Linear2D:
        assert layer.bias is None, "the GPT's linear layers have no bias"
        if transposed:  # in-features over the row group, out over the column group
            w = self._param(layer.weight, Shard(1), Shard(0))
            return Linear2D(w, fwd_group=self.row, bwd_group=self.col, logits_mesh=None)
        w = self._param(layer.weight, Shard(0), Shard(1))
        logits_mesh = self.mesh["tp"] if logits and self.row is not None else None
        return Linear2D(
            w, fwd_group=self.col, bwd_group=self.row if reduce_dx else None, logits_mesh=logits_mesh
        )

    def norm(self, norm: nn.LayerNorm) -> LayerNorm2D:
        weight = self._param(norm.weight, Replicate(), Shard(0))
        bias = self._param(norm.bias, Replicate(), Shard(0))
        return LayerNorm2D(norm, weight, bias, self.col)

    def embedding(self, emb: nn.Embedding, *, vocab_split: bool) -> Embedding2D:
        split = vocab_split and self.row is not None
        weight = self._param(emb.weight, Shard(0) if split else Replicate(), Shard(1))
        start = self.mesh.get_local_rank("tp") * weight.to_local().shape[0] if split else 0
        return Embedding2D(weight, self.row if split else None, start)
