"""The mixture-of-experts layer: a router, routed experts, an optional shared expert.

Plain modules like trainer/model.py: expert parallelism is applied from outside
(trainer/parallelize.py sets `MoE.comm` and shards the experts' weights over the ep axis).

- Router (torchtitan's TokenChoiceTopKRouter, DeepSeek-V3 section 2.1.2): logits = x W (no bias),
  softmax or sigmoid scores, optional group-limited routing, the auxiliary-loss-free expert bias
  (added to the scores for the choice only), top-k, weights = the chosen scores (renormalised over
  the top-k when moe_norm_topk: transformers' norm_topk_prob) x moe_route_scale. With the same
  weights the layer equals transformers' DeepSeek-V3 and Qwen3-MoE blocks
  (tests/trainer/test_moe_transformers.py).
- "balanced" routing (Megatron's --moe-router-force-load-balancing): token i's j-th expert is
  (i k + j) mod E whatever the scores; the weights are still the router's scores of those experts,
  so the router trains. Dropless in both modes: every token reaches its k experts.
- The load-balancing loss (ModelConfig.moe_aux_loss): DeepSeek-V3's sequence-wise form (eq. 17-20;
  Switch's f_i P_i per sequence, summed over the layers) or the Switch form over the micro-batch as
  transformers computes it for Mixtral, Qwen3-MoE and OLMoE (averaged over the layers). It reaches
  the gradient through AuxLossScaler, so the reported loss stays the language-model loss.
- Experts: one weight tensor per matrix, [E, ...], computed with torch._grouped_mm on GPUs with
  it (compute capability >= 9, bf16), else a loop over each expert's slice of the sorted tokens.
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial

from trainer.contract.model import ModelConfig

GROUPED_MM_ALIGN = 16  # torch._grouped_mm wants each group's rows 16-byte aligned; 16 rows covers fp32


@dataclass
class MoEComm:
    """How one MoE layer talks to its peers (set by trainer/parallelize.py; one process: defaults).

    ep_group: the expert-parallel group (experts split E / ep per rank, tokens all-to-all'd);
    tp_group: the ranks holding parts of the same sequences (tp_size of them): the tensor-parallel
    group under sequence parallelism (each rank routes 1/tp of each sequence), the context-parallel
    group, or cp x tp; the auxiliary loss counts over whole sequences. stage_group: every rank of
    this pipeline stage (dp x cp x tp: the global batch's token counts, for the expert bias and
    imbalance);
    expert_grad_scale: edp / dp, so that the expert-DP mean (over edp replicas, each summing the
    contributions of ep x ... ranks) equals the dense data-parallel mean."""

    ep_group: dist.ProcessGroup | None = None
    ep_size: int = 1
    ep_rank: int = 0
    tp_group: dist.ProcessGroup | None = None
    tp_size: int = 1
    stage_group: dist.ProcessGroup | None = None
    expert_grad_scale: float = 1.0


class AuxLossScaler(torch.autograd.Function):
    """Identity on the layer's output; backward also sends `scale` into the auxiliary loss, so its
    gradient (coef x d aux) joins the model's without the loss value changing (Megatron's
    MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


class GradScale(torch.autograd.Function):
    """Identity forward; the gradient times `scale` (the experts' weights: MoEComm.expert_grad_scale)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def local(t: torch.Tensor, partial_grad: bool = False) -> torch.Tensor:
    """A DTensor's local shard (plain tensors as they are). partial_grad: a replicated weight used
    on this rank's tokens only, so its gradient is this rank's share of a sum (Partial)."""
    if not isinstance(t, DTensor):
        return t
    if partial_grad:
        return t.to_local(grad_placements=[Partial()] * t.device_mesh.ndim)
    return t.to_local()


def in_backward() -> bool:
    """True while autograd runs a backward pass (activation checkpointing's recompute)."""
    return torch._C._current_graph_task_id() != -1


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        bias = torch.zeros(cfg.num_experts) if cfg.moe_bias_update_rate > 0 else None
        # State, as transformers' e_score_correction_bias: a trained bias is saved, a checkpoint's loaded.
        self.register_buffer("expert_bias", bias)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T: in the compute dtype, or with moe_router_fp32 in fp32 from fp32 casts of x and W
        (autocast off: it would cast them back), as transformers' DeepseekV3TopkRouter."""
        if not self.cfg.moe_router_fp32:
            return self.gate(x)
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.float(), self.gate.weight.float())

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """fp32 scores of every expert, (..., E)."""
        logits = logits.float()
        return logits.softmax(-1) if self.cfg.moe_router_score == "softmax" else logits.sigmoid()

    def select(self, scores: torch.Tensor, balanced: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(experts, weights), both (N, k), for scores (N, E)."""
        cfg = self.cfg
        n, e, k = scores.shape[0], cfg.num_experts, cfg.moe_top_k
        if balanced:
            experts = (torch.arange(n * k, device=scores.device) % e).view(n, k)
        else:
            choice = scores.detach()
            if self.expert_bias is not None:
                choice = choice + self.expert_bias
            if cfg.moe_groups > 1:
                choice = self._limit_groups(choice)
            experts = choice.topk(k, dim=-1).indices
        weights = scores.gather(1, experts)
        if cfg.moe_norm_topk:  # DeepSeek-V3's norm_topk_prob is true; false leaves sigmoid's scores
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return experts, weights * cfg.moe_route_scale

    def _limit_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """Keep the moe_topk_groups best groups of experts per token (DeepSeek-V3): a group scores
        its best expert (softmax) or the sum of its best two (sigmoid); the others are masked."""
        cfg = self.cfg
        n, g = choice.shape[0], cfg.moe_groups
        grouped = choice.view(n, g, -1)
        if cfg.moe_router_score == "sigmoid":
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        else:
            group_scores = grouped.amax(-1)
        keep = group_scores.topk(cfg.moe_topk_groups, dim=-1).indices
        mask = torch.zeros(n, g, dtype=torch.bool, device=choice.device).scatter_(1, keep, True)
        return grouped.masked_fill(~mask.unsqueeze(-1), float("-inf")).view(n, -1)


def balance_probs(scores: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """The scores the auxiliary losses average: softmax's as they are, sigmoid's normalised."""
    return scores / scores.sum(-1, keepdim=True) if cfg.moe_router_score == "sigmoid" else scores


def sequence_aux_loss(
    scores: torch.Tensor,
    experts: torch.Tensor,
    cfg: ModelConfig,
    seq_len: int,
    tp_group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """sum_i f_i P_i, averaged over sequences (DeepSeek-V3 eq. 17-20): f_i = E / (k T) x the
    tokens of the sequence choosing expert i, P_i = the mean over the sequence of its normalised
    score. scores (B, t, E), experts (B, t, k): t = T / tp tokens of each sequence on this rank
    under sequence parallelism, where f is summed over the tp group (no gradient) and P_i is this
    rank's share of the mean: the tp ranks' losses add up to the whole sequence's."""
    b, e, k = scores.shape[0], cfg.num_experts, cfg.moe_top_k
    probs = balance_probs(scores, cfg)
    with torch.no_grad():
        counts = torch.zeros(b, e, device=scores.device).scatter_add_(
            1, experts.reshape(b, -1), torch.ones(b, experts[0].numel(), device=scores.device)
        )
        if tp_group is not None:
            dist.all_reduce(counts, group=tp_group)
        f = counts * (e / (k * seq_len))
    return (f * probs.sum(1) / seq_len).sum(-1).mean()


def batch_aux_loss(
    scores: torch.Tensor,
    experts: torch.Tensor,
    cfg: ModelConfig,
    num_tokens: int,
    tp_group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """E sum_i f_i P_i over the micro-batch's tokens, divided by the model's MoE layers: f_i = the
    share of the tokens choosing expert i (summed over the k choices), P_i = the mean score of
    expert i. One layer's value is transformers' load_balancing_loss_func (Mixtral, Qwen3-MoE,
    OLMoE; tests/trainer/test_moe_transformers.py), k for a balanced router. transformers pools
    every layer's tokens into one f and one P (products across layers, so a pipeline stage could
    not compute its share alone); the mean of the layers' losses has the same scale and gradient
    per layer of the same form. scores (N, E) and experts (N, k) are this rank's tokens; under
    sequence parallelism f is summed over the tp group (no gradient) and P_i is this rank's share
    of the mean over num_tokens, the micro-batch's whole sequences: the tp ranks' losses add up."""
    e = cfg.num_experts
    probs = balance_probs(scores, cfg)
    with torch.no_grad():
        counts = torch.zeros(e, device=scores.device).index_add_(
            0, experts.flatten(), torch.ones(experts.numel(), device=scores.device)
        )
        if tp_group is not None:
            dist.all_reduce(counts, group=tp_group)
    return e * (counts / num_tokens * probs.sum(0) / num_tokens).sum() / cfg.num_moe_layers


class GroupedExperts(nn.Module):
    """num_experts experts of the model's MLP kind: w1 (gate, or fc for GELU) and w3 (SwiGLU's fc)
    are (E, h, f), w2 (E, f, h). Under expert parallelism each rank holds E / ep of them."""

    def __init__(self, cfg: ModelConfig, num_experts: int):
        super().__init__()
        h, f = cfg.hidden_size, cfg.expert_ffn_size
        self.swiglu = cfg.mlp == "swiglu"
        self.w1 = nn.Parameter(torch.empty(num_experts, h, f))
        self.w2 = nn.Parameter(torch.empty(num_experts, f, h))
        self.w3 = nn.Parameter(torch.empty(num_experts, h, f)) if self.swiglu else None
        # activation_checkpoint moe_act: the activation's output discarded and recomputed in
        # backward, its inputs (the first GEMMs' outputs) kept (recompute_without_output)
        self.recompute_act = False

    def forward(
        self, x: torch.Tensor, counts: list[int], grad_scale: float = 1.0, probs: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x: tokens sorted by expert, counts[e] of them for local expert e; probs: each row's
        routing weight, applied in the activation (Megatron-LM's weighted SwiGLU: the combine is
        then a plain sum, which keeps nothing), or None (unweighted)."""
        # In the compute dtype: the experts' own weights may be fp32 beside bf16 activations (edp 1:
        # no FSDP2 casts them) or under autocast (one GPU, no data parallelism).
        autocast = torch.is_autocast_enabled(x.device.type)
        dtype = torch.get_autocast_dtype(x.device.type) if autocast else x.dtype
        x = x.to(dtype)
        probs = probs.to(dtype) if probs is not None else None
        weights = [
            GradScale.apply(local(w), grad_scale).to(dtype)
            for w in (self.w1, self.w2, self.w3)
            if w is not None
        ]
        if use_grouped_mm(x):
            return self._grouped(x, counts, weights, probs)
        outs = []
        chunks = probs.split(counts) if probs is not None else [None] * len(counts)
        for e, (chunk, p) in enumerate(zip(x.split(counts), chunks, strict=True)):
            outs.append(self._mlp(chunk, p, *(w[e] for w in weights)))
        return torch.cat(outs) if outs else x[:0]

    def _mlp(
        self,
        x: torch.Tensor,
        p: torch.Tensor | None,
        w1: torch.Tensor,
        w2: torch.Tensor,
        w3: torch.Tensor | None = None,
    ) -> torch.Tensor:
        inputs = (x @ w1, x @ w3) if w3 is not None else (x @ w1,)
        return self._act_then(p, inputs, lambda h: h @ w2)

    def _act_then(
        self,
        p: torch.Tensor | None,
        inputs: tuple[torch.Tensor, ...],
        down: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """down(p x activation(*inputs)): SwiGLU's silu(gate) * up or GELU, weighted, then the down
        projection."""
        if self.recompute_act:
            return recompute_without_output(_activation, (p, *inputs), down)
        return down(_activation(p, *inputs))

    def _grouped(
        self, x: torch.Tensor, counts: list[int], weights: list[torch.Tensor], probs: torch.Tensor | None
    ) -> torch.Tensor:
        """One grouped GEMM per matrix over every expert: each group padded to GROUPED_MM_ALIGN rows."""
        padded = [-(-c // GROUPED_MM_ALIGN) * GROUPED_MM_ALIGN for c in counts]
        ends = list(itertools.accumulate(padded))  # on the host: counts are, no device sync
        rows = torch.cat(
            [torch.arange(e - p, e - p + c, device=x.device) for c, p, e in zip(counts, padded, ends)]
        )
        xp = x.new_zeros(ends[-1], x.shape[1])
        xp[rows] = x  # index_put keeps the indices for the backward; index_copy would keep x too
        pp = None
        if probs is not None:  # the padding rows weighted 0
            pp = probs.new_zeros(ends[-1])
            pp[rows] = probs
        offs = torch.tensor(ends, device=x.device, dtype=torch.int32)
        w1, w2, *w3 = weights
        inputs = tuple(torch._grouped_mm(xp, w, offs=offs) for w in (w1, *w3))
        return self._act_then(pp, inputs, lambda h: torch._grouped_mm(h, w2, offs=offs))[rows]


class WeightedActivation(torch.autograd.Function):
    """p x silu(gate) x up (SwiGLU) or p x gelu(gate) (GELU) per row, keeping for the backward only
    its inputs (gate and up, and p), as Megatron-LM's fused weighted_bias_swiglu: autograd's ops
    would keep SiLU's output and the product besides (4 f a row, here 2 f). The backward computes
    the activation's pieces again, in place where it can (a few f-wide temporaries at a time, as
    autograd's backward of the unfused ops holds)."""

    @staticmethod
    def forward(
        ctx, p: torch.Tensor | None, gate: torch.Tensor, up: torch.Tensor | None = None
    ) -> torch.Tensor:
        ctx.save_for_backward(p, gate, up)
        return _weighted(p, gate, up)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        p, gate, up = ctx.saved_tensors
        weighted = grad * p.unsqueeze(-1) if p is not None else grad
        dp = None
        if up is None:  # GELU
            if p is not None and ctx.needs_input_grad[0]:
                dp = (F.gelu(gate, approximate="tanh").mul_(grad)).sum(-1)
            return dp, torch.ops.aten.gelu_backward(weighted, gate, approximate="tanh"), None
        # SwiGLU: d up = w g silu, d silu = w g up, d gate = d silu s (1 + gate (1 - s)), s = sigmoid(gate)
        s = torch.sigmoid(gate)
        silu = gate * s
        if p is not None and ctx.needs_input_grad[0]:
            dp = (silu * up).mul_(grad).sum(-1)
        dup = silu.mul_(weighted)
        dsilu = weighted.mul_(up) if weighted is not grad else grad * up
        dgate = dsilu.mul_(s.neg().add_(1).mul_(gate).add_(1).mul_(s))
        return dp, dgate, dup


def _weighted(p: torch.Tensor | None, gate: torch.Tensor, up: torch.Tensor | None) -> torch.Tensor:
    out = F.silu(gate) * up if up is not None else F.gelu(gate, approximate="tanh")
    return out.mul_(p.unsqueeze(-1)) if p is not None else out


def _activation(p: torch.Tensor | None, gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    return WeightedActivation.apply(p, gate, up)


class _Recipe:
    """A saved tensor kept as how to get it back (`value()`) instead of as itself."""

    __slots__ = ()

    def value(self) -> torch.Tensor:
        raise NotImplementedError


class _Discarded(_Recipe):
    """A saved tensor left out of the graph: recomputed from its function's inputs when the
    backward first unpacks it (and kept for the other ops that saved it, while they need it)."""

    __slots__ = ("fn", "inputs", "value_")

    def __init__(self, fn: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...]):
        self.fn, self.inputs, self.value_ = fn, inputs, None

    def value(self) -> torch.Tensor:
        if self.value_ is None:
            with torch.no_grad():
                self.value_ = self.fn(*self.inputs)
        return self.value_


class _Picked(_Recipe):
    """... one of a function's several outputs (latent attention's q, k and v)."""

    __slots__ = ("index", "recipe")

    def __init__(self, recipe: _Discarded, index: int):
        self.recipe, self.index = recipe, index

    def value(self) -> torch.Tensor:
        return self.recipe.value()[self.index]


class _Held(_Recipe):
    """A saved tensor's source kept as it is (gather_again: a norm's output shard)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def value(self) -> torch.Tensor:
        return self.tensor


class _Redistributed(_Recipe):
    """... and laid out as its consumer saw it: a sequence-parallel norm's output all-gathered
    again, as Megatron-LM's sequence parallelism gathers its linears' inputs in the backward."""

    __slots__ = ("mesh", "placements", "recipe", "value_")

    def __init__(self, recipe: _Recipe, mesh, placements):
        self.recipe, self.mesh, self.placements, self.value_ = recipe, mesh, placements, None

    def value(self) -> torch.Tensor:
        if self.value_ is None:
            with torch.no_grad():
                self.value_ = self.recipe.value().redistribute(self.mesh, self.placements)
        return self.value_


class _Local(_Recipe):
    """... as its local tensor."""

    __slots__ = ("recipe",)

    def __init__(self, recipe: _Redistributed):
        self.recipe = recipe

    def value(self) -> torch.Tensor:
        return self.recipe.value().to_local()


class _Viewed(_Recipe):
    """... of which an op saved a view of the same (contiguous) values in another shape."""

    __slots__ = ("recipe", "shape")

    def __init__(self, recipe: _Recipe, shape: torch.Size):
        self.recipe, self.shape = recipe, shape

    def value(self) -> torch.Tensor:
        return self.recipe.value().view(self.shape)


def recompute_without_output(
    fn: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]],
    inputs: tuple[torch.Tensor | None, ...],
    consume: Callable[[Any], torch.Tensor],
    consumer: nn.Module | None = None,
) -> torch.Tensor:
    """consume(fn(*inputs)) keeping fn's inputs but neither fn's intermediates nor its output(s), as
    Megatron-LM's CheckpointWithoutOutput (--recompute-modules moe_act, layernorm): fn runs under
    non-reentrant checkpointing (its backward recomputes it from the inputs it keeps), and where
    consume's ops save fn's output (the down projection saves its input) a saved-tensor hook keeps
    a recipe instead, recomputing the output when the backward needs it. SwiGLU's experts keep
    their gate and up (2 f a routed token) instead of also SiLU's output and the product (4 f).
    `consumer`: the module consume calls first, whose input hooks (tensor parallelism's
    PrepareModuleInput) may lay the output out anew (sequence parallelism's all-gather): what its
    ops save of that is left out too, and gathered again when needed."""
    from torch.utils.checkpoint import checkpoint

    out = checkpoint(fn, *inputs, use_reentrant=False)
    recipe = _Discarded(fn, inputs)
    return _consume_leaving_out(out, recipe, consume, consumer, leave_out_output=True)


def gather_again(
    fn: Callable[..., torch.Tensor],
    inputs: tuple[torch.Tensor, ...],
    consume: Callable[[torch.Tensor], torch.Tensor],
    consumer: nn.Module,
) -> torch.Tensor:
    """consume(fn(*inputs)) where `consumer`'s input hook all-gathers fn's output (sequence
    parallelism's PrepareModuleInput before attention or a dense MLP): the ops that save the
    gathered tensor keep fn's output, the rank's shard, instead, and it is all-gathered again
    when the backward needs it. Megatron-LM's sequence parallelism (and Transformer Engine's
    LayerNormLinear) saves its linears' input so, where torch's linears save the gathered input:
    tp times the bytes (Korthikanti et al. 2022 sec. 4.2.2 count the shard)."""
    out = fn(*inputs)
    return _consume_leaving_out(out, _Held(out), consume, consumer, leave_out_output=False)


def _consume_leaving_out(
    out: torch.Tensor, recipe: _Recipe, consume: Callable[[torch.Tensor], torch.Tensor],
    consumer: nn.Module | None, leave_out_output: bool,
) -> torch.Tensor:  # fmt: skip
    """consume(out) with the saved-tensor hooks of recompute_without_output and gather_again: what
    consume's ops save of `out` (leave_out_output) and of `consumer`'s laid-out input is packed as
    a recipe for it."""
    # id -> (a weak reference, its recipe): autograd keeps a saved-tensor hook's functions with
    # every tensor they saved, and they must keep none of these tensors alive
    targets: dict[int, tuple[weakref.ref, _Recipe]] = {}
    if leave_out_output and isinstance(out, tuple):  # several outputs: each its part of the recipe
        for i, part in enumerate(out):
            targets[id(part)] = (weakref.ref(part), _Picked(recipe, i))
    elif leave_out_output:
        targets[id(out)] = (weakref.ref(out), recipe)

    def capture(module: nn.Module, args: tuple) -> None:
        laid_out = args[0] if args else None
        if isinstance(laid_out, DTensor) and laid_out is not out:
            laid_out_again = _Redistributed(recipe, laid_out.device_mesh, laid_out.placements)
            targets[id(laid_out)] = (weakref.ref(laid_out), laid_out_again)
            # ... and its local tensor, which a consumer on plain tensors saves (latent attention's
            # replicated down-projections read the gathered input's to_local())
            local_tensor = laid_out._local_tensor
            targets[id(local_tensor)] = (weakref.ref(local_tensor), _Local(laid_out_again))

    def pack(t: torch.Tensor):
        entry = targets.get(id(t))
        if entry is not None and entry[0]() is t:
            return entry[1]
        base = t._base  # a linear on a (b, s, h) input saves its (b s, h) view
        entry = targets.get(id(base)) if base is not None else None
        if entry is not None and entry[0]() is base and t.is_contiguous() and base.is_contiguous():
            return _Viewed(entry[1], t.shape)
        # Every other saved tensor as itself, detached (the same storage, no grad_fn): kept as
        # itself, a pipeline's first rank kept a micro-batch's whole graph past the step (2.2 MB
        # of 9.4 on a 4-layer tiny Llama at pp 2, held from autograd's C++ only; memcheck's
        # optimizer phase), which is why layernorm recompute was refused with pp > 1 until
        # issue 37 (docs/perfmodel.md, "Megatron's recompute modules").
        return t.detach()

    def unpack(saved):
        return saved.value() if isinstance(saved, _Recipe) else saved

    handle = consumer.register_forward_pre_hook(capture) if consumer is not None else None
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return consume(out)
    finally:
        if handle is not None:
            handle.remove()


def use_grouped_mm(x: torch.Tensor) -> bool:
    return (
        x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
        and torch.cuda.get_device_capability(x.device)[0] >= 9
    )  # fmt: skip


def balanced_counts(num_assignments: int, num_experts: int) -> list[int]:
    """Tokens per expert when assignment i goes to expert i mod E."""
    base, extra = divmod(num_assignments, num_experts)
    return [base + (1 if e < extra else 0) for e in range(num_experts)]


class MoE(nn.Module):
    """The MLP of a mixture-of-experts layer: routed experts plus an optional shared expert."""

    def __init__(self, cfg: ModelConfig, layer_id: int, shared: nn.Module | None = None):
        super().__init__()
        self.cfg, self.layer_id = cfg, layer_id
        self.router = Router(cfg)
        self.experts = GroupedExperts(cfg, cfg.num_experts)
        self.shared = shared
        self.comm = MoEComm()
        self.balanced = False  # BenchmarkConfig.moe_routing == "balanced"
        self.capacity_factor: float | None = None  # BenchmarkConfig.moe_capacity_factor (None: dropless)
        self.aux_scale = 1.0  # the auxiliary loss's share of the step's loss (1 / micro-batches)
        # This step's tokens per expert (this rank's) and auxiliary loss (summed over micro-batches).
        self.register_buffer("tokens_per_expert", torch.zeros(cfg.num_experts), persistent=False)
        self.register_buffer("aux_loss", torch.zeros(()), persistent=False)
        self.register_buffer("dropped", torch.zeros(()), persistent=False)  # assignments over capacity

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, t, h): a plain tensor, or under tensor + sequence parallelism a DTensor of this
        rank's t = T / tp tokens of each sequence (the router and shared expert are replicated
        DTensors; their gradients add up over tp). Returns this rank's (B, t, h) as a tensor."""
        cfg = self.cfg
        logits = local(self.router.logits(x))
        shared = local(self.shared(x)) if self.shared is not None else None
        x = local(x)
        b, t, h = x.shape
        scores = self.router.scores(logits.reshape(b * t, -1))
        experts, weights = self.router.select(scores, self.balanced)
        out = self._route(x.reshape(b * t, h), experts, weights).view(b, t, h)
        recording = not in_backward()  # not again in activation checkpointing's recompute
        if recording:
            with torch.no_grad():
                self.tokens_per_expert.index_add_(
                    0, experts.flatten(), torch.ones(experts.numel(), device=x.device)
                )
        if cfg.moe_aux_loss_coef > 0:
            if cfg.moe_aux_loss == "batch":
                form = batch_aux_loss(scores, experts, cfg, b * t * self.comm.tp_size, self.comm.tp_group)
            else:
                form = sequence_aux_loss(
                    scores.view(b, t, -1),
                    experts.view(b, t, -1),
                    cfg,
                    t * self.comm.tp_size,
                    self.comm.tp_group,
                )
            aux = cfg.moe_aux_loss_coef * form
            if recording:
                self.aux_loss += aux.detach()
            out = AuxLossScaler.apply(out, aux, self.aux_scale)
        return out + shared if shared is not None else out

    def _route(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Every token through its k experts (dispatched over ep ranks), weighted and summed.
        One h-wide copy of the routed tokens is kept for the backward: the experts' input (the
        permuted rows; trainer-side gathers and scatters keep only their indices). The routing
        weights travel with the tokens and weigh the experts' activation (GroupedExperts), so the
        experts' outputs back in token order are summed, which keeps nothing (before issue 37 a
        batched (1 x k) @ (k x h) product weighted them and kept them: a second h-wide copy)."""
        n, k = x.shape[0], self.cfg.moe_top_k
        flat, w = experts.flatten(), weights.flatten()
        if self.capacity_factor is None:
            order = flat.argsort(stable=True)  # assignments sorted by expert
            counts = self._counts(flat, n * k)
        else:
            order, counts = self._within_capacity(flat, w)
        token = order // k
        routed, probs = x[token], w[order]
        comm = self.comm
        if comm.ep_size == 1:
            y = self.experts(routed, counts, comm.expert_grad_scale, probs)
        else:
            y = self._expert_parallel(routed, probs, counts)
        if self.capacity_factor is None:
            out = y[order.argsort()].view(n, k, -1).sum(1)  # assignment i k + j: token i's j-th expert
        else:  # a dropped assignment's row stays zero (index_put keeps only the indices)
            out = y.new_zeros(n * k, y.shape[1]).index_put((order,), y).view(n, k, -1).sum(1)
        return out.to(x.dtype)

    def _within_capacity(self, flat: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Token drop (BenchmarkConfig.moe_capacity_factor, Megatron-LM's "probs" policy): each
        expert keeps at most ceil(factor x assignments / experts) of this rank's assignments, those
        of the highest routing weight. Returns the kept assignments sorted by expert (by weight
        within one) and the kept count per expert; counts the dropped ones (the step's result)."""
        total, e = flat.numel(), self.cfg.num_experts
        capacity = math.ceil(self.capacity_factor * total / e)
        demand = self._counts(flat, total)
        counts = [min(d, capacity) for d in demand]
        by_weight = w.detach().argsort(descending=True, stable=True)
        by_expert = by_weight[flat[by_weight].argsort(stable=True)]  # by expert, heaviest first
        # the first counts[i] of expert i's run of demand[i]: position j of the kept is j plus the
        # dropped ones of the experts before it
        skipped = [0, *itertools.accumulate(d - c for d, c in zip(demand[:-1], counts[:-1], strict=True))]
        kept = sum(counts)
        shift = torch.repeat_interleave(torch.tensor(skipped, device=flat.device),
                                        torch.tensor(counts, device=flat.device), output_size=kept)  # fmt: skip
        if not in_backward():
            self.dropped += total - kept
        return by_expert[torch.arange(kept, device=flat.device) + shift], counts

    def _counts(self, flat: torch.Tensor, num_assignments: int) -> list[int]:
        """Assignments per expert. Balanced routing's are known without looking at the data
        (which the memory oracle's fake tensors do not have)."""
        if self.balanced:
            return balanced_counts(num_assignments, self.cfg.num_experts)
        counts = torch.zeros(self.cfg.num_experts, dtype=torch.int64, device=flat.device)
        return counts.index_add_(0, flat, torch.ones_like(flat)).tolist()

    def _expert_parallel(self, routed: torch.Tensor, probs: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Dispatch each assignment and its routing weight to the rank holding its expert (two
        all-to-alls, as Megatron-LM's dispatcher sends the permuted probabilities), run the local
        experts, send the results back (all-to-all). Split sizes are exchanged first."""
        from torch.distributed.nn.functional import all_to_all_single

        comm, e = self.comm, self.cfg.num_experts
        per_rank = e // comm.ep_size
        if self.balanced:  # every rank routes the same number of tokens the same way
            received = [counts[comm.ep_rank * per_rank : (comm.ep_rank + 1) * per_rank]] * comm.ep_size
        else:
            mine = torch.tensor(counts, device=routed.device)
            theirs = torch.empty_like(mine)
            dist.all_to_all_single(theirs, mine, group=comm.ep_group)
            received = theirs.view(comm.ep_size, per_rank).tolist()
        send = [sum(counts[r * per_rank : (r + 1) * per_rank]) for r in range(comm.ep_size)]
        recv = [sum(row) for row in received]
        got = all_to_all_single(
            routed.new_empty(sum(recv), routed.shape[1]), routed, recv, send, comm.ep_group
        )
        # Rows arrive by source rank, then by expert: regroup them by expert.
        expert_of = torch.arange(per_rank, device=routed.device).repeat(comm.ep_size)
        repeats = torch.tensor([c for row in received for c in row], device=routed.device)
        by_expert = torch.repeat_interleave(expert_of, repeats, output_size=sum(recv)).argsort(stable=True)
        local_counts = [sum(row[j] for row in received) for j in range(per_rank)]
        got_probs = all_to_all_single(probs.new_empty(sum(recv)), probs, recv, send, comm.ep_group)
        y = self.experts(got[by_expert], local_counts, comm.expert_grad_scale, got_probs[by_expert])
        y = y[by_expert.argsort()]
        return all_to_all_single(y.new_empty(routed.shape), y, send, recv, comm.ep_group)

    def reset_stats(self) -> None:
        self.tokens_per_expert.zero_()
        self.aux_loss.zero_()
        self.dropped.zero_()


def moe_layers(modules: list[nn.Module]) -> list[MoE]:
    return [m for module in modules for m in module.modules() if isinstance(m, MoE)]


def configure(
    modules: list[nn.Module], *, balanced: bool, aux_scale: float, capacity_factor: float | None = None
) -> None:
    """The trial's routing mode, the auxiliary loss's share of a step's loss and the experts'
    capacity factor (None: dropless) on every layer."""
    for m in moe_layers(modules):
        m.balanced, m.aux_scale, m.capacity_factor = balanced, aux_scale, capacity_factor


@torch.no_grad()
def finish_step(modules: list[nn.Module], num_microbatches: int, dp: int) -> dict[int, torch.Tensor]:
    """After the optimizer step: sum every layer's token counts over the stage's ranks (the global
    batch), move the expert bias towards balance (DeepSeek-V3: b_i += gamma sign(mean load -
    load_i)), and return per layer id (imbalance = max / mean tokens per expert, auxiliary loss
    averaged over the global batch's micro-batches, the share of assignments dropped over
    capacity). Tensors: the memory oracle's are fake."""
    layers = moe_layers(modules)
    if not layers:
        return {}
    n = len(layers)
    packed = torch.cat([torch.stack([m.tokens_per_expert for m in layers]).flatten(),
                        torch.stack([m.aux_loss for m in layers]), torch.stack([m.dropped for m in layers])])  # fmt: skip
    group = layers[0].comm.stage_group
    if group is not None:
        dist.all_reduce(packed, group=group)
    counts = packed[: -2 * n].view(n, -1)
    aux = packed[-2 * n : -n] / (num_microbatches * dp)
    dropped = packed[-n:]
    out = {}
    for i, (m, c) in enumerate(zip(layers, counts, strict=True)):
        if m.router.expert_bias is not None:
            m.router.expert_bias += m.cfg.moe_bias_update_rate * torch.sign(c.mean() - c)
        m.reset_stats()
        # tokens per expert are the router's choices, dropped or not: the dropped share of them
        out[m.layer_id] = torch.stack([c.amax() / c.mean(), aux[i], dropped[i] / c.sum()])
    return out
